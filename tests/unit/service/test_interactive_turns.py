"""InteractiveCalls' `max_models_per_pass` (actors/service/trainer/interactive_calls.py): capped at 1, calls that
are all ready go through the base one model at a time, the models taking turns, and each model's calls still
return exactly what the engine returns for that model alone; uncapped, the same ready calls share one pass."""

from __future__ import annotations

import pytest
import torch

from actors.engine.interactive_model import AdamStep, InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name
from tests.helpers.models import VOCAB, tiny_model

MODELS = ("alice:train:0", "bob:train:0", "carol:train:0")
ADAM = AdamStep(learning_rate=0.05)


def call_datums(seed: int) -> tuple[CallDatum, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(CallDatum(tuple(torch.randint(0, VOCAB, (length,), generator=generator).tolist()),
                           {"target_tokens": torch.randint(0, VOCAB, (length,), generator=generator),
                            "weights": torch.ones(length)})
                 for length in (6 + seed, 11))


def submit_all(calls: InteractiveCalls) -> dict[str, list]:
    """Each model: forward_backward, optim_step, then forward (which sees the stepped adapter)."""
    futures = {}
    for index, model_id in enumerate(MODELS):
        calls.create_model(model_id, 4, seed=index)
        name = adapter_name(model_id)
        futures[model_id] = [calls.submit(model_id, 1, "forward_backward", ModelCall(name, call_datums(index))),
                             calls.submit(model_id, 2, "optim_step", ADAM),
                             calls.submit(model_id, 3, "forward", ModelCall(name, call_datums(index + 10)))]
    return futures


def run_to_end(cap: int | None) -> tuple[list[list[str]], dict[str, list]]:
    passes: list[list[str]] = []
    calls = InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=0, max_models_per_pass=cap,
                             on_step=lambda step: passes.append(step["models"]))
    futures = submit_all(calls)
    while calls.step():
        pass
    return passes, futures


def alone(index: int):
    """The engine alone: the model's forward_backward, its optimizer step, then its forward."""
    base = from_module(tiny_model("llama", VOCAB), None)
    model = InteractiveModel(base, "alone", 4, seed=index)
    (trained,) = run_calls(base, [ModelCall("alone", call_datums(index))], backward=True)
    model.optim_step(ADAM)
    (scored,) = run_calls(base, [ModelCall("alone", call_datums(index + 10))], backward=False)
    return trained, scored


@pytest.mark.parametrize("cap", [1, None])
def test_capped_passes_take_one_model_at_a_time_and_each_gets_its_answer_alone(cap):
    passes, futures = run_to_end(cap)
    if cap == 1:
        assert passes == [[model] for model in MODELS] * 2   # turns in the models' order, forward_backward first
    else:
        assert passes == [sorted(MODELS)] * 2                 # all three fused, twice
    for index, model_id in enumerate(MODELS):
        trained, scored = alone(index)
        got_trained, _, got_scored = (future.result(timeout=0) for future in futures[model_id])
        for got, expected in ((got_trained, trained), (got_scored, scored)):
            assert got.loss_sum == expected.loss_sum, model_id
            for ours, theirs in zip(got.logprobs, expected.logprobs, strict=True):
                assert torch.equal(ours, theirs), model_id


def test_a_cap_below_one_is_refused():
    with pytest.raises(ValueError, match="max_models_per_pass"):
        InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), max_models_per_pass=0)


def test_a_lone_model_never_waits_the_window_and_models_seen_lately_are_waited_for():
    """The window is how long a call waits for partners at most: before any pass the first calls wait it out;
    after, a pass runs as soon as every model that took part in a pass lately has its next call here (a lone
    user's calls at once; users whose loops go in step meet without waiting it out)."""
    calls = InteractiveCalls(from_module(tiny_model("llama", VOCAB), None), window_s=60.0)
    alice, bob = MODELS[:2]
    for index, model_id in enumerate((alice, bob)):
        calls.create_model(model_id, 4, seed=index)

    def fb(model_id: str, seq: int, seed: int):
        return calls.submit(model_id, seq, "forward_backward", ModelCall(adapter_name(model_id), call_datums(seed)))

    first = [fb(alice, 1, 0), fb(bob, 1, 1)]
    assert not calls.due() and calls.wait_left() > 50   # nobody seen in a pass yet: the window
    calls.step()
    assert all(future.done() for future in first)
    second = fb(alice, 2, 2)
    assert not calls.due() and 0 < calls.wait_left() <= 60   # bob took part lately: waited for
    fb(bob, 2, 3)
    assert calls.due()                                        # everyone seen lately is here: at once
    calls.step()
    assert second.done()
    calls.remove_model(bob)
    fb(alice, 3, 4)
    assert calls.due() and calls.wait_left() == 0.0           # alone now: its calls never wait
