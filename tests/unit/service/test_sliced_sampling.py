"""A Tinker sampling batch decoded in slices (`interactive_sample_slice_s`), the trainer's other work between them:
the samples are those of the batch decoded whole (the reference: `sample`, itself checked against transformers'
`generate` in tests/unit/engine/test_tinker_sampling.py), other models' calls run and are answered while it decodes
(they waited for its end: minutes of a trainer's time, every job's step on it included), an adapter it decodes
through stays on the base till it ends, and a step beside it is planned with its KV cache counted."""

from __future__ import annotations

import pytest
import torch

from actors.engine.generate import _attached
from actors.engine.interactive_model import AdamStep
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from actors.engine.tinker_sampling import SampleCall, SampleRun, sample
from actors.service.trainer.interactive_calls import InteractiveCalls, adapter_name
from tests.helpers.interactive import random_b_model
from tests.helpers.models import VOCAB, tiny_model

pytestmark = pytest.mark.unit

PROMPT = (5, 17, 3, 99, 42, 7)


def training_call(name: str, seed: int) -> ModelCall:
    generator = torch.Generator().manual_seed(seed)
    datums = tuple(CallDatum(tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist()),
                             {"target_tokens": torch.randint(0, VOCAB, (n,), generator=generator),
                              "weights": torch.ones(n)}) for n in (7, 12))
    return ModelCall(name, datums)


def as_lists(results) -> list:
    return [[(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences] for result in results]


def test_a_batch_decoded_in_slices_with_training_between_samples_what_it_samples_whole():
    base = from_module(tiny_model("llama", VOCAB), None)
    random_b_model(base, "sampler", 4, 1, scale=0.5)
    trained = random_b_model(base, "trained", 4, 2, scale=0.3)
    calls = [SampleCall("sampler", PROMPT, num_samples=3, max_tokens=20, seed=7, top_k=30),
             SampleCall(None, (8, 9), max_tokens=12, temperature=0.0, prompt_logprobs=True)]
    whole = sample(base, calls)
    run, slices = SampleRun(base, calls), 0
    while not run.advance(seconds=0.0):   # one token a slice
        slices += 1
        run_calls(base, [training_call("trained", slices)], backward=True)   # another model's pass, its step
        trained.optim_step(AdamStep(learning_rate=0.05))
        assert run.held_bytes() > 0
    assert slices == 19
    sliced = run.results()
    assert as_lists(sliced) == as_lists(whole)
    assert sliced[1].prompt_logprobs == whole[1].prompt_logprobs


def test_other_models_calls_run_while_a_sampling_decodes_and_its_adapter_stays_till_it_ends():
    base = from_module(tiny_model("llama", VOCAB), None)
    calls = InteractiveCalls(base, window_s=0, sample_slice_s=0.0)
    calls.create_model("reader", 4, seed=1)
    calls.create_model("writer", 4, seed=2)
    sampler = adapter_name("reader")
    call = SampleCall(sampler, PROMPT, num_samples=2, max_tokens=24, seed=5)
    (whole,) = sample(base, [call])
    sampled = calls.submit_sample(call)
    assert calls.step() and not sampled.done()   # the batch started: one token so far
    calls.remove_model("reader")                  # its adapter is read by the batch: taken off after it
    trained = calls.submit("writer", 1, "forward_backward", training_call(adapter_name("writer"), 3))
    stepped = calls.submit("writer", 2, "optim_step", AdamStep(learning_rate=0.05))
    assert calls.step() and trained.done() and not sampled.done()   # answered while the sampling decodes
    assert calls.step() and stepped.done() and not sampled.done()
    assert trained.result().loss_sum > 0 and sampler in _attached(base.model)
    while not sampled.done():
        assert calls.step()
    assert as_lists([sampled.result()]) == as_lists([whole])
    calls.step()
    assert sampler not in _attached(base.model), "taken off once the batch had ended"
    assert calls.sampling_bytes() == 0 and not calls.step()
