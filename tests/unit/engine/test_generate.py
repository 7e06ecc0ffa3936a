"""greedy_generate against transformers' own greedy `generate` (base model) and PEFT's (with an adapter,
merged into the model or not), on a tiny random Llama, one prompt at a time on the reference side, all
prompts batched on ours (one batch over several adapters and the base, with a KV cache); the tokens that
sampling keeps (top_k, top_p, min_p) against transformers' warpers."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from actors.checkpoint.peft_io import save_adapter
from actors.engine.adapter_surgery import add_adapter, remove_adapter
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.generate import Sampling, greedy_generate, greedy_generate_many, kept_probabilities
from actors.engine.models import BaseModel, from_module
from actors.spec.lora_config import LoraConfig

VOCAB = 300
EOS = 2
PROMPTS = [[5, 17, 42], [101, 7, 250, 33, 9, 64, 12, 88], [77], [150, 151, 152, 153, 154]]
MAX_NEW = 8
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=EOS)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init, so the argmax is far from ties
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.15)
    return model


def _reference_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                        eos: int) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                       do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                       pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def models() -> tuple[BaseModel, torch.nn.Module]:
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    return from_module(model, tokenizer=None), reference


def random_adapter(base: BaseModel, name: str, seed: int, folder: Path) -> Path:
    """An adapter with random nonzero lora_B attached to the fused model, saved in PEFT's format."""
    handle = add_adapter(base.model, name, LORA, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in handle.layers.values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.3)
    return save_adapter(handle, folder, "tiny-llama")


@pytest.fixture(scope="module")
def adapter_dir(models, tmp_path_factory) -> Path:
    """Adapter `a` (random_adapter)."""
    return random_adapter(models[0], "a", 3, tmp_path_factory.mktemp("adapter-a"))


def test_base_model_matches_transformers_generate(models, adapter_dir):
    # adapter `a` is attached (adapter_dir fixture); adapter=None must bypass it
    base, reference = models
    expected = _reference_generate(reference, PROMPTS, MAX_NEW, EOS)
    assert greedy_generate(base, None, PROMPTS, MAX_NEW, {EOS}) == expected
    assert len({tuple(e) for e in expected}) > 1


def test_adapter_matches_peft_generate(models, adapter_dir):
    from peft import PeftModel

    base, reference = models
    peft_model = PeftModel.from_pretrained(copy.deepcopy(reference), str(adapter_dir)).eval()
    expected = _reference_generate(peft_model, PROMPTS, MAX_NEW, EOS)
    got = greedy_generate(base, "a", PROMPTS, MAX_NEW, {EOS})
    assert got == expected
    # the adapter really changes the continuations
    assert got != greedy_generate(base, None, PROMPTS, MAX_NEW, {EOS})


def test_stop_token_ends_a_sequence_and_is_kept(models, adapter_dir):
    base, reference = models
    free = _reference_generate(reference, PROMPTS, MAX_NEW, eos=-1)
    stop = free[1][2]  # the third token of prompt 1's free continuation
    expected = _reference_generate(reference, PROMPTS, MAX_NEW, eos=stop)
    got = greedy_generate(base, None, PROMPTS, MAX_NEW, {stop})
    assert got == expected
    assert got[1] == free[1][:3] and got[1][-1] == stop
    assert all(len(g) <= MAX_NEW for g in got)


def test_training_mode_restored_and_edge_cases(models, adapter_dir):
    base, _ = models
    layers = [m for m in base.model.modules() if isinstance(m, FusedLoraLinear)]
    for layer in layers:
        layer.adapters.train(True)
    greedy_generate(base, "a", PROMPTS[:1], 2, {EOS})
    assert all(layer.adapters.training for layer in layers)
    assert greedy_generate(base, "a", PROMPTS, 0, {EOS}) == [[] for _ in PROMPTS]
    assert greedy_generate(base, None, [], 4, {EOS}) == []
    with pytest.raises(ValueError, match="empty"):
        greedy_generate(base, None, [[]], 4, {EOS})
    with pytest.raises(ValueError, match="no adapter named"):
        greedy_generate(base, "missing", PROMPTS, 4, {EOS})


def test_reattached_adapter_after_removal_gives_same_output(models, adapter_dir):
    from actors.checkpoint.peft_io import load_adapter_weights

    base, _ = models
    before = greedy_generate(base, "a", PROMPTS, MAX_NEW, {EOS})
    remove_adapter(base.model, "a")
    handle = add_adapter(base.model, "a", LORA, seed=99)
    load_adapter_weights(handle, adapter_dir)
    assert greedy_generate(base, "a", PROMPTS, MAX_NEW, {EOS}) == before


def test_one_batch_over_two_adapters_and_the_base_matches_each_merged_model(models, adapter_dir, tmp_path):
    """Requests for `a`, `b` and the base interleaved in one batch: each equals `generate` of its own model
    (PEFT's adapter merged into a copy of the base: `merge_and_unload`)."""
    from peft import PeftModel

    base, reference = models
    b_dir = random_adapter(base, "b", 5, tmp_path / "adapter-b")
    try:
        merged = {name: PeftModel.from_pretrained(copy.deepcopy(reference), str(path)).merge_and_unload().eval()
                  for name, path in (("a", adapter_dir), ("b", b_dir))}
        merged[None] = reference
        requests = [(adapter, prompt) for prompt in PROMPTS for adapter in ("b", None, "a")]
        got = greedy_generate_many(base, requests, MAX_NEW, {EOS})
        expected = [_reference_generate(merged[adapter], [prompt], MAX_NEW, EOS)[0] for adapter, prompt in requests]
        assert got == expected
        by_adapter = {adapter: [g for (a, _), g in zip(requests, got, strict=True) if a == adapter]
                      for adapter in ("a", "b", None)}
        assert len({tuple(map(tuple, outputs)) for outputs in by_adapter.values()}) == 3   # all three differ
        assert base.model.config._attn_implementation == "aspen_varlen"   # the fused steps' attention is back
    finally:
        remove_adapter(base.model, "b")


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(0, 0.9, 0.0), (0, 0.3, 0.0), (40, 0.95, 0.0), (0, 1.0, 0.05),
                                                       (50, 0.8, 0.1), (0, 1e-9, 0.0)])
def test_the_tokens_sampling_keeps_are_those_transformers_warpers_keep(top_k, top_p, min_p):
    """`kept_probabilities` against transformers' TopK, TopP and MinP warpers applied in `generate`'s order, on a
    batch of random logits. A token whose place against a threshold float32 rounding decides is left out of the
    comparison: top_p's cumulative sums (ours from the likeliest down, transformers' from the least likely up)
    each round V terms, so differ by at most 2 V 2^-24; min_p's probabilities by a few roundings of their own."""
    generator = torch.Generator().manual_seed(top_k + int(top_p * 1000) + int(min_p * 100))
    scores = torch.randn(6, VOCAB, generator=generator) * 3.0
    reference = scores.clone()
    for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) + (
            [MinPLogitsWarper(min_p)] if min_p else []):
        reference = warper(None, reference)
    expected = torch.isfinite(reference)
    kept = kept_probabilities(scores, top_k, top_p, min_p) > 0
    # the decisive quantities in float64: each token's mass of likelier tokens (after top_k), its probability
    # over the likeliest's (after top_p)
    masked = scores.double().masked_fill(~torch.isfinite(TopKLogitsWarper(top_k)(None, scores.clone()))
                                         if top_k else torch.zeros_like(scores, dtype=torch.bool), float("-inf"))
    probabilities = torch.softmax(masked, dim=-1)
    ordered, order = torch.sort(probabilities, dim=-1, descending=True)
    before = torch.zeros_like(probabilities).scatter(-1, order, torch.cumsum(ordered, dim=-1) - ordered)
    relative = probabilities / probabilities.amax(dim=-1, keepdim=True)
    rounding = 2 * VOCAB * 2.0 ** -24
    decided = torch.ones_like(kept)
    if top_p < 1:
        decided &= (before - top_p).abs() > rounding
    if min_p > 0:
        decided &= (relative - min_p).abs() > 16 * 2.0 ** -24
    assert decided.float().mean() > 0.9, "the case tests too few tokens"
    assert bool((~expected[decided]).any()), "the case drops no token"
    assert torch.equal(kept[decided], expected[decided])
    assert bool(kept.any(dim=-1).all())   # the likeliest always stays


def test_a_nucleus_of_the_likeliest_token_alone_samples_as_greedy(models, adapter_dir):
    """top_p below the likeliest token's probability, or min_p 1, keeps only that token: sampled decoding is
    then the greedy decoding, whatever the generator draws."""
    base, _ = models
    requests = [(None, prompt) for prompt in PROMPTS]
    greedy = greedy_generate_many(base, requests, MAX_NEW, {EOS})
    for narrow in ({"top_p": 1e-9}, {"min_p": 1.0}):
        sampling = Sampling(1.0, 0, torch.Generator().manual_seed(7), **narrow)
        assert greedy_generate_many(base, requests, MAX_NEW, {EOS}, sampling) == greedy, narrow
    wide = Sampling(1.0, 0, torch.Generator().manual_seed(7))
    assert greedy_generate_many(base, requests, MAX_NEW, {EOS}, wide) != greedy   # sampling itself does differ
