"""LoRA on the LM head (the Tinker API's `train_unembed`: actors/engine/head_lora.py) against PEFT with `lm_head`
among its target modules, as the independent reference: a call's log-probabilities and every gradient (the head's A
and B included) equal PEFT's to a bound derived from the arithmetic (tests/helpers/tolerances.py, with the head
adapter's two products added to the chain); a model that trains the head and one that does not, fused in one pass,
each get exactly what they get alone, and nothing reaches the other; sampling (prompt log-probabilities, top-k,
greedy tokens) goes through the head adapter as PEFT's `generate` does; saved weights load into PEFT as they are
and back onto a base as a sampler; a state saved with a head adapter is refused by a model without one, saying
why."""

from __future__ import annotations

import json
import math

import pytest
import torch

from actors.checkpoint.interactive_state import hold_sampler_weights, read_state, save_state
from actors.engine.interactive_model import InteractiveModel
from actors.engine.interactive_step import ModelCall, run_calls
from actors.engine.models import from_module
from actors.engine.tinker_sampling import SampleCall, sample
from tests.helpers.interactive import datum, peft_twin
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

pytestmark = pytest.mark.unit


def base():
    return from_module(tiny_model("llama", VOCAB), None)


def head_model(shared, name: str, rank: int, seed: int, *, train_unembed: bool = True) -> InteractiveModel:
    """A model whose B matrices (the head's too) are random, so that every adapter changes the outputs."""
    made = InteractiveModel(shared, name, rank, seed=seed, train_unembed=train_unembed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter_name, parameter in made.adapter.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return made


def head_terms(config, rank: int, **chain) -> int:
    """The chain's terms with the head adapter's two products (h A^T: hidden terms; its B^T: rank terms)."""
    return llama_chain_terms(config, **chain) + config.hidden_size + rank


def gradients(made: InteractiveModel) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in made.adapter.named_parameters()}


def test_a_call_through_an_adapted_head_equals_peft_with_lm_head_targeted():
    shared = base()
    made = head_model(shared, "alice-0", 4, 1)
    assert made.adapter.peft_targets[-1] == "lm_head"
    datums = (datum(1, 9), datum(2, 17))
    (output,) = run_calls(shared, [ModelCall("alice-0", datums)], backward=True)
    reference, weights = peft_twin(made)
    assert {"lm_head.lora_A.weight", "lm_head.lora_B.weight"} <= set(weights)
    config = reference.config
    for index, item in enumerate(datums):
        logits = reference(input_ids=torch.tensor(item.tokens)[None]).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, item.inputs["target_tokens"][:, None])[:, 0]
        (-(logprobs * item.inputs["weights"])).sum().backward()
        bound = rounding_tolerance(head_terms(config, 4, sequence=len(item.tokens), tokens=len(item.tokens),
                                              backward=False), float(logprobs.abs().max()))
        assert float((output.logprobs[index] - logprobs.detach()).abs().max()) <= bound
    terms = head_terms(config, 4, sequence=17, tokens=26)
    for name, parameter in made.adapter.named_parameters():
        expected = weights[name].grad
        assert float(expected.abs().max()) > 1e-6, name
        assert float((parameter.grad - expected).abs().max()) <= rounding_tolerance(terms, float(
            expected.abs().max())), name


def test_a_head_model_and_a_plain_one_fused_get_exactly_what_each_gets_alone():
    shared = base()
    first = head_model(shared, "alice-0", 4, 1)
    second = head_model(shared, "bob-0", 8, 2, train_unembed=False)
    calls = [ModelCall("alice-0", (datum(1, 7), datum(2, 19))),
             ModelCall("bob-0", (datum(3, 11, rl=True), datum(4, 5, rl=True)), "importance_sampling")]
    fused = run_calls(shared, calls, backward=True)
    fused_grads = gradients(first), gradients(second)
    for index, (call, made) in enumerate(zip(calls, (first, second), strict=True)):
        for other in (first, second):
            other.optimizer.zero_grad(set_to_none=True)
        (alone,) = run_calls(shared, [call], backward=True)
        assert alone.loss_sum == fused[index].loss_sum
        for ours, theirs in zip(alone.logprobs, fused[index].logprobs, strict=True):
            assert torch.equal(ours, theirs)
        for name, gradient in gradients(made).items():
            assert torch.equal(gradient, fused_grads[index][name]), name
        other = second if made is first else first
        assert all(p.grad is None for p in other.adapter.parameters())


def test_sampling_goes_through_the_head_adapter_as_peft_generates():
    shared = base()
    made = head_model(shared, "alice-0", 4, 1)
    reference, _ = peft_twin(made)
    prompt = tuple(datum(5, 12).tokens)
    (result,) = sample(shared, [SampleCall("alice-0", prompt, max_tokens=6, temperature=0.0, prompt_logprobs=True,
                                           topk_prompt=3)])
    with torch.no_grad():
        expected = reference.generate(input_ids=torch.tensor(prompt)[None], max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        logits = reference(input_ids=torch.tensor(prompt)[None]).logits[0].float()
    assert result.sequences[0].tokens == expected
    logprobs = torch.log_softmax(logits, dim=-1)
    scored = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    bound = rounding_tolerance(head_terms(reference.config, 4, sequence=12, tokens=12, backward=False),
                               float(scored.abs().max()))
    assert result.prompt_logprobs[0] is None
    assert max(abs(ours - float(theirs)) for ours, theirs in zip(result.prompt_logprobs[1:], scored, strict=True)
               ) <= bound
    assert [ids for ids, _ in result.topk_prompt[1:]] == logprobs[:-1].topk(3).indices.tolist()
    # the base alone (no adapter) is not changed by the head adapter beside it
    (plain,) = sample(shared, [SampleCall(None, prompt, max_tokens=6, temperature=0.0)])
    with torch.no_grad(), reference.disable_adapter():
        alone = reference.generate(input_ids=torch.tensor(prompt)[None], max_new_tokens=6, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert plain.sequences[0].tokens == alone


def test_saved_weights_load_into_peft_and_back_as_a_sampler(tmp_path):
    from peft import PeftModel

    shared = base()
    made = head_model(shared, "alice-0", 4, 1)
    folder = save_state(made, tmp_path / "state", "tiny", "alice:train:0", "alice")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert "lm_head" in config["target_modules"]
    assert json.loads((folder / "interactive_state.json").read_text())["train_unembed"] is True
    reference = PeftModel.from_pretrained(tiny_model("llama", VOCAB), folder)
    tokens = torch.tensor(datum(6, 10).tokens)[None]
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits[0].float()
        twin, _ = peft_twin(made)
        direct = twin(input_ids=tokens).logits[0].float()
    assert torch.equal(expected, direct)   # the files hold the adapter exactly
    held = hold_sampler_weights(shared, "alice-sampler", folder)
    assert held.head is not None
    for (name, ours), (_, theirs) in zip(held.named_parameters(), made.adapter.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    facts, weights, optimizer = read_state(folder)
    plain = InteractiveModel(shared, "carol-0", 4, seed=3)
    with pytest.raises(ValueError, match=r"train_unembed True \(this model: False\)"):
        plain.load(weights, optimizer)
    again = InteractiveModel(shared, "dave-0", 4, seed=3, train_unembed=True)
    again.load(weights, optimizer)
    assert torch.equal(again.adapter.head.lora_B, made.adapter.head.lora_B)


def test_the_head_alone_is_trained_with_train_unembed_only():
    shared = base()
    made = head_model(shared, "alice-0", 4, 1, train_unembed=True)
    only = InteractiveModel(shared, "bob-0", 4, seed=2, train_attn=False, train_mlp=False, train_unembed=True)
    assert [name for name, _ in only.adapter.named_parameters()] == ["lm_head.lora_A.weight", "lm_head.lora_B.weight"]
    with torch.no_grad():
        only.adapter.head.lora_B.copy_(made.adapter.head.lora_B)
        only.adapter.head.lora_A.copy_(made.adapter.head.lora_A)
    (output,) = run_calls(shared, [ModelCall("bob-0", (datum(1, 9),))], backward=True)
    assert only.adapter.head.lora_A.grad is not None and float(only.adapter.head.lora_A.grad.abs().max()) > 0
    (plain,) = run_calls(shared, [ModelCall("carol", (datum(1, 9),))], backward=False)   # the base alone
    assert not torch.equal(output.logprobs[0], plain.logprobs[0])
    with pytest.raises(ValueError, match="all false: nothing to train"):
        InteractiveModel(shared, "erin-0", 4, train_attn=False, train_mlp=False, train_unembed=False)


@pytest.mark.parametrize("tied", [False, True])
def test_an_adapted_head_merges_into_a_model_of_its_own_head(tmp_path, tied, tiny_tokenizer):
    """`aspen export --merge` / the Tinker API's external weights: the merged model gives the adapter's logits (PEFT's,
    unmerged) and its input embedding is the base's. On a tied base (SmolLM2 ties its head to its input embedding)
    PEFT's own merge would change the embedding too; the merged model is saved with a head of its own instead."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.checkpoint.adapter_export import export_merged
    from actors.checkpoint.peft_io import save_adapter
    from tests.helpers.models import tiny_config

    config = tiny_config("llama")
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    plain = type(tiny_model("llama"))(config).eval()
    plain.save_pretrained(tmp_path / "base")
    tiny_tokenizer.save_pretrained(tmp_path / "base")
    shared = from_module(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32), None)
    assert (shared.lm_head.weight is shared.model.get_input_embeddings().weight) == tied
    made = head_model(shared, "alice-0", 4, 1)
    adapter = save_adapter(made.adapter, tmp_path / "adapter", str(tmp_path / "base"))
    merged_folder = export_merged(adapter, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_folder, dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base",
                                                                               dtype=torch.float32), adapter).eval()
    tokens = torch.tensor([datum(7, 9).tokens])
    with torch.no_grad():
        got, expected = merged(tokens).logits, reference(tokens).logits
    assert not merged.config.tie_word_embeddings
    assert torch.equal(merged.get_input_embeddings().weight, plain.get_input_embeddings().weight)
    # merging rounds W + s B A once in float32 where PEFT computes W x + s B (A x): a few float32 epsilons a layer
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_a_saved_states_tensor_names_say_which_parts_its_model_trained(model_type):
    """What a Tinker model created from a saved state trains (`create_training_client_from_state`): the parts its
    saved tensors name, each combination of the three flags (the experts' stacks are the MLP on an MoE base)."""
    from actors.engine.interactive_model import trained_parts
    from tests.helpers.model_families import build_config, build_model

    shared = from_module(build_model(build_config(model_type)), None)
    for index, (attn, mlp, unembed) in enumerate([(True, True, True), (True, False, False), (False, True, False),
                                                  (False, False, True), (True, False, True)]):
        made = InteractiveModel(shared, f"m{index}", 4, train_attn=attn, train_mlp=mlp, train_unembed=unembed)
        assert trained_parts([name for name, _ in made.adapter.named_parameters()]) == {
            "train_attn": attn, "train_mlp": mlp, "train_unembed": unembed}, (attn, mlp, unembed)
        made.close()


def test_the_adapted_head_in_bfloat16_is_the_float32_heads_within_one_rounding_of_its_logits():
    """The head adapter on a bfloat16 base (the CUDA path's dtype), on a CPU, against the same arithmetic in float32
    from the same bfloat16 values. The adapter's update is float32 in both (its masters, `hidden.float()`); what
    differs is the head's product, rounded once to bfloat16 (oneDNN accumulates in float32): each logit moves by at
    most delta = u_bf16 max|h W^T|. So each log-probability (z_t - logsumexp z) moves by at most 2 delta, each
    softmax row's L1 by at most e^(2 delta) - 1, and B's gradient, sum_r g_r (p_r - onehot_r) (x) u_r, by at most
    (e^(2 delta) - 1) sum_r |g_r| |u_r| in Frobenius norm; float32's own rounding is added to each bound."""
    from actors.engine.head_lora import HeadLora, adapted_log_probs
    from actors.engine.loss import IDENTITY
    from tests.helpers.tolerances import unit_roundoff

    generator = torch.Generator().manual_seed(5)
    head16 = torch.nn.Linear(64, VOCAB, bias=False).to(torch.bfloat16)
    head32 = torch.nn.Linear(64, VOCAB, bias=False)
    with torch.no_grad():
        head16.weight.copy_(torch.randn(VOCAB, 64, generator=generator) * 0.2)
        head32.weight.copy_(head16.weight.float())
    hidden16 = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (40,), generator=generator)
    upstream = torch.randn(40, generator=generator)
    lora = HeadLora(4, 32, 64, VOCAB, generator=torch.Generator().manual_seed(1), device=torch.device("cpu"))
    with torch.no_grad():
        lora.lora_B.copy_(torch.randn(VOCAB, 4, generator=generator) * 0.3)

    def run(hidden, head):
        lora.lora_A.grad = lora.lora_B.grad = None
        hidden = hidden.detach().requires_grad_()
        logprobs = adapted_log_probs(hidden, head, lora, targets, IDENTITY)
        (logprobs * upstream).sum().backward()
        return logprobs.detach(), lora.lora_B.grad.clone(), lora.lora_A.grad.clone()

    low, low_b, low_a = run(hidden16, head16)
    full, full_b, full_a = run(hidden16.float(), head32)
    hidden = hidden16.float()
    delta = unit_roundoff(torch.bfloat16) * float((hidden @ head32.weight.t()).abs().max())
    terms = 64 + 4 + VOCAB   # the head's and the update's sums, the logsumexp
    assert float((low - full).abs().max()) <= 2 * delta + rounding_tolerance(terms, float(full.abs().max()))
    update = (hidden @ lora.lora_A.detach().t()) * lora.scaling
    bound = math.expm1(2 * delta) * float((upstream.abs() * update.norm(dim=1)).sum())
    assert float((low_b - full_b).norm()) <= bound + rounding_tolerance(terms + 40, float(full_b.norm()))
    assert float(full_b.norm()) > 2 * bound   # a worst case, yet below the gradient itself: it says something
    assert float(full_a.norm()) > 0 and torch.isfinite(low_a).all()
