"""Interactive models' calls (actors/engine/interactive_step.py, interactive_model.py): two models' calls fused in
one pass give each exactly what it gets alone (outputs and gradients: equality, for the reasons
tests/unit/engine/test_isolation.py gives); a call's log-probabilities, losses and gradients equal PEFT's on the
same adapter, one datum at a time through Hugging Face's forward (to a bound derived from the arithmetic:
tests/helpers/tolerances.py); an optimizer step is AdamW's first update worked out by hand, with the given
settings and clipping; a call the base cannot take is refused before anything runs, naming the datum."""

from __future__ import annotations

import pytest
import torch

from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.engine.tinker_losses import LossInputError
from tests.helpers.interactive import datum, peft_twin, random_b_model
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

pytestmark = pytest.mark.unit


def base():
    return from_module(tiny_model("llama", VOCAB), None)


def model(base_model, name: str, rank: int, seed: int) -> InteractiveModel:
    return random_b_model(base_model, name, rank, seed)


def gradients(made: InteractiveModel) -> dict[str, torch.Tensor]:
    return {name: parameter.grad.clone() for name, parameter in made.adapter.named_parameters()}


def clear(*models: InteractiveModel) -> None:
    for made in models:
        made.optimizer.zero_grad(set_to_none=True)


def test_two_models_fused_get_exactly_what_each_gets_alone():
    shared = base()
    first, second = model(shared, "alice-0", 4, 1), model(shared, "bob-0", 8, 2)
    supervised = ModelCall("alice-0", (datum(1, 7), datum(2, 19)), "cross_entropy")
    reinforced = ModelCall("bob-0", (datum(3, 11, rl=True), datum(4, 5, rl=True), datum(5, 23, rl=True)), "ppo",
                           {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    fused = run_calls(shared, [supervised, reinforced], backward=True)
    fused_grads = gradients(first), gradients(second)
    for index, (call, made) in enumerate(((supervised, first), (reinforced, second))):
        clear(first, second)
        (alone,) = run_calls(shared, [call], backward=True)
        assert alone.loss_sum == fused[index].loss_sum
        for ours, theirs in zip(alone.logprobs + alone.elementwise_loss,
                                fused[index].logprobs + fused[index].elementwise_loss, strict=True):
            assert torch.equal(ours, theirs)
        for name, gradient in gradients(made).items():
            assert torch.equal(gradient, fused_grads[index][name]), name
        other = second if made is first else first
        assert all(p.grad is None for p in other.adapter.parameters())   # nothing reached the other model


def test_a_call_equals_peft_one_datum_at_a_time():
    shared = base()
    made = model(shared, "alice-0", 4, 1)
    datums = (datum(1, 9), datum(2, 17))
    (output,) = run_calls(shared, [ModelCall("alice-0", datums)], backward=True)
    reference, weights = peft_twin(made)
    config = reference.config
    for index, item in enumerate(datums):
        logits = reference(input_ids=torch.tensor(item.tokens)[None]).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, item.inputs["target_tokens"][:, None])[:, 0]
        (-(logprobs * item.inputs["weights"])).sum().backward()
        bound = rounding_tolerance(llama_chain_terms(config, sequence=len(item.tokens), tokens=len(item.tokens),
                                                     backward=False), float(logprobs.abs().max()))
        assert float((output.logprobs[index] - logprobs.detach()).abs().max()) <= bound
    terms = llama_chain_terms(config, sequence=17, tokens=26)
    for name, parameter in made.adapter.named_parameters():
        expected = weights[name].grad
        assert float(expected.abs().max()) > 1e-6, name
        assert float((parameter.grad - expected).abs().max()) <= rounding_tolerance(terms, float(
            expected.abs().max())), name


def top_k_datum(seed: int, length: int, k: int) -> CallDatum:
    """A top-k distillation datum: K target tokens a position, weights a teacher's renormalised probabilities."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (length,), generator=generator)
    targets = torch.stack([torch.randperm(VOCAB, generator=generator)[:k] for _ in range(length)])
    weights = torch.softmax(torch.randn(length, k, generator=generator), dim=-1)
    weights[0] = 0.0   # a position the recipe leaves out (the prompt's)
    return CallDatum(tuple(tokens.tolist()), {"target_tokens": targets, "weights": weights})


def test_top_k_targets_give_peft_s_log_probabilities_loss_and_gradients():
    """cross_entropy with (N, K) target_tokens and weights (Tinker's top-k distillation): the (N, K) log-probabilities
    of the targets, -sum w log p, and its gradients as PEFT's forward gives them; a datum of one target a position in
    the same call is unchanged by its neighbour; mismatched shapes are refused, naming the datum and the shape."""
    shared = base()
    made = model(shared, "alice-0", 4, 1)
    datums = (top_k_datum(1, 9, 3), datum(2, 11), top_k_datum(3, 6, 5))
    (output,) = run_calls(shared, [ModelCall("alice-0", datums)], backward=True)
    reference, weights = peft_twin(made)
    config = reference.config
    total = 0.0
    for index, item in enumerate(datums):
        logits = reference(input_ids=torch.tensor(item.tokens)[None]).logits[0].float()
        targets = item.inputs["target_tokens"]
        picked = torch.log_softmax(logits, dim=-1)
        logprobs = picked.gather(1, targets[:, None])[:, 0] if targets.dim() == 1 else picked.gather(1, targets)
        loss = (-(logprobs * item.inputs["weights"])).sum()
        loss.backward()
        total += float(loss)
        assert output.logprobs[index].shape == targets.shape == output.elementwise_loss[index].shape
        bound = rounding_tolerance(llama_chain_terms(config, sequence=len(item.tokens), tokens=len(item.tokens),
                                                     backward=False), float(logprobs.abs().max()))
        assert float((output.logprobs[index] - logprobs.detach()).abs().max()) <= bound
    assert output.loss_sum == pytest.approx(total, rel=1e-4)
    terms = llama_chain_terms(config, sequence=11, tokens=26)
    for name, parameter in made.adapter.named_parameters():
        expected = weights[name].grad
        assert float(expected.abs().max()) > 1e-6, name
        assert float((parameter.grad - expected).abs().max()) <= rounding_tolerance(terms, float(
            expected.abs().max())), name
    clear(made)
    bad = top_k_datum(4, 5, 3)
    bad.inputs["weights"] = torch.ones(5)
    with pytest.raises(LossInputError, match=r"datum 1: loss_fn_inputs 'weights' has shape \(5,\); it needs "
                                             r"target_tokens' \(5, 3\)"):
        run_calls(shared, [ModelCall("alice-0", (datum(5, 4), bad))], backward=True)
    with pytest.raises(LossInputError, match=r"'target_tokens' has shape \(5, 3\); it needs one value per "
                                             r"model_input token \(5,\)"):
        run_calls(shared, [ModelCall("alice-0", (CallDatum(bad.tokens, {**top_k_datum(4, 5, 3).inputs,
                                                                         "logprobs": torch.zeros(5, 3),
                                                                         "advantages": torch.zeros(5, 3)}),),
                                     "importance_sampling")], backward=True)


def test_an_optimizer_step_is_adamws_first_update_with_the_given_settings():
    shared = base()
    made = model(shared, "alice-0", 4, 1)
    run_calls(shared, [ModelCall("alice-0", (datum(1, 12),))], backward=True)
    before = {name: p.detach().clone() for name, p in made.adapter.named_parameters()}
    grads = gradients(made)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    step = AdamStep(learning_rate=0.01, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.1,
                    grad_clip_norm=float(norm) / 4)
    metrics = made.optim_step(step)
    assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
    for name, parameter in made.adapter.named_parameters():
        g = grads[name].double() / 4   # clipped to a quarter of its norm
        # first step, bias-corrected: m = g, v = g^2; decoupled decay first
        expected = before[name].double() * (1 - 0.01 * 0.1) - 0.01 * g / (g.abs() + 1e-6)
        assert torch.allclose(parameter.detach().double(), expected, rtol=1e-5, atol=1e-7), name
        assert parameter.grad is None   # cleared for the next calls


def test_a_call_the_base_cannot_take_is_refused_before_anything_runs():
    shared = base()
    first, second = model(shared, "alice-0", 4, 1), model(shared, "bob-0", 4, 2)
    good = ModelCall("alice-0", (datum(1, 5),))
    outside = CallDatum((1, 2, VOCAB + 3), {"target_tokens": torch.tensor([1, 2, 3]), "weights": torch.ones(3)})
    with pytest.raises(LossInputError, match=rf"datum 0: model_input holds a token outside the base's vocabulary "
                                             rf"\(0..{VOCAB - 1}\)"):
        run_calls(shared, [good, ModelCall("bob-0", (outside,))], backward=True)
    assert all(p.grad is None for made in (first, second) for p in made.adapter.parameters())
    with pytest.raises(ValueError, match="rank must be between 1 and 256"):
        InteractiveModel(shared, "carol-0", 0)
    with pytest.raises(ValueError, match="adam_params: beta2 must be in"):
        first.optim_step(AdamStep(beta2=1.0))


def test_a_call_larger_than_a_pass_goes_in_parts_whose_outputs_and_gradients_are_the_whole_calls():
    """split_passes: a trainer's interactive pass holds at most its step's tokens; a larger call goes in parts of
    whole datums, calls that fit share a pass. Each datum's outputs are the same whatever else is in its pass
    (isolation: equality); the gradients, summed over the parts instead of in one pass, differ by the rounding
    of summing the same terms in another order (tests/helpers/tolerances.py)."""
    from actors.engine.interactive_step import join_outputs, split_passes

    shared = base()
    made = model(shared, "alice-0", 4, 1)
    whole = ModelCall("alice-0", (datum(1, 9), datum(2, 13), datum(3, 6), datum(4, 17)))
    small = ModelCall("alice-0", (datum(5, 4),))
    passes = split_passes([whole, small], 24)
    assert [[(index, [len(d.tokens) for d in part.datums]) for index, part in group] for group in passes] == [
        [(0, [9, 13])], [(0, [6, 17])], [(1, [4])]]
    assert split_passes([whole], None) == [[(0, whole)]]
    assert [[len(d.tokens) for _, p in g for d in p.datums] for g in split_passes([whole], 5)] == [[9], [13], [6], [17]]
    (expected,) = run_calls(shared, [whole], backward=True)
    expected_grads = gradients(made)
    clear(made)
    parts = [run_calls(shared, [part for index, part in group if index == 0], backward=True)[0]
             for group in passes[:2]]
    joined = join_outputs(parts)
    for got, want in zip(joined.logprobs + joined.elementwise_loss, expected.logprobs + expected.elementwise_loss,
                         strict=True):
        assert torch.equal(got, want)
    tokens = sum(len(d.tokens) for d in whole.datums)
    terms = llama_chain_terms(shared.model.config, sequence=17, tokens=tokens)
    for name, gradient in gradients(made).items():
        bound = rounding_tolerance(terms, float(expected_grads[name].abs().max()))
        assert float((gradient - expected_grads[name]).abs().max()) <= bound, name
    assert joined.loss_sum == pytest.approx(expected.loss_sum, rel=4 * 2**-24)
