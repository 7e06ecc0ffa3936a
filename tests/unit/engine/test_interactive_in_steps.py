"""Interactive models' forward_backward calls sharing a fused step of aspen's own jobs (`FusedTrainer.run_step`'s
`calls`): in that one forward/backward, each job trains exactly as in the same step without the calls (its loss,
its optimizer step, its adapter), and each call returns and leaves exactly what it returns and leaves in a pass of
its own (`run_calls`: outputs and its adapter's gradients; a user's custom loss too), on the CPU in float32
(equality, for the reasons tests/unit/engine/test_isolation.py gives); a trainer whose stream has no place for them
refuses them."""

from __future__ import annotations

import pytest
import torch

from actors.engine.custom_loss import CustomLoss
from actors.engine.interactive_step import FusedCalls, ModelCall, check_call, run_calls
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.interactive import datum, random_b_model
from tests.helpers.models import VOCAB, random_examples, tiny_model

pytestmark = pytest.mark.unit


def _setup():
    """A base with two SFT jobs (one with accumulation, so only one optimizer steps) and two interactive models,
    made the same way each time."""
    torch.manual_seed(0)
    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = FusedTrainer(base, step_tokens=4096)
    chosen = []
    for index, accumulation in enumerate((1, 2)):
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=3,
                       grad_accum=accumulation, max_steps=3, lr=1e-2, lora={"r": 4, "alpha": 8,
                                                                          "target_modules": "all-linear"})
        examples = random_examples(index, count=6, vocab=VOCAB)
        job = TrainingJob.create(spec, base, examples, [], seed=index)
        trainer.add_job(job)
        chosen.append((job, examples[:3]))
    models = [random_b_model(base, "alice-0", 4, 1), random_b_model(base, "bob-0", 8, 2),
              random_b_model(base, "carol-0", 4, 3)]
    calls = [ModelCall("alice-0", (datum(1, 7), datum(2, 19)), "cross_entropy"),
             ModelCall("bob-0", (datum(3, 11, rl=True), datum(4, 5, rl=True)), "ppo",
                       {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
             ModelCall("carol-0", (datum(5, 9, rl=True), datum(6, 4, rl=True)), "custom", custom=CUSTOM)]
    return base, trainer, chosen, models, calls


def _node(name: str, op: str, target: str, *args) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


# a user's custom loss as the SDK sends it: -(logprobs * advantages).sum() + 0.5 * (logprobs ** 2).mean(), and
# the advantages' sum as a metric
CUSTOM = CustomLoss.of("pg", [("logprobs", 1), ("advantages", 1)], [
    _node("logprobs", "placeholder", "logprobs"), _node("advantages", "placeholder", "advantages"),
    _node("mul", "call_function", "operator.mul", {"ref": "logprobs"}, {"ref": "advantages"}),
    _node("sum_1", "call_method", "sum", {"ref": "mul"}),
    _node("neg", "call_function", "operator.neg", {"ref": "sum_1"}),
    _node("pow_1", "call_function", "operator.pow", {"ref": "logprobs"}, 2),
    _node("mean", "call_method", "mean", {"ref": "pow_1"}),
    _node("mul_1", "call_function", "operator.mul", 0.5, {"ref": "mean"}),
    _node("add", "call_function", "operator.add", {"ref": "neg"}, {"ref": "mul_1"}),
    _node("sum_2", "call_method", "sum", {"ref": "advantages"}),
    _node("output", "output", "output", {"tuple": [{"ref": "add"}, {"dict": {"custom/a:sum": {"ref": "sum_2"}}}]})])


def _job_state(trainer: FusedTrainer) -> dict[str, torch.Tensor]:
    return {f"{job.name}.{name}": value.detach().clone() for job in trainer.jobs.values()
            for name, value in job.adapter.named_parameters()}


def _gradients(models) -> dict[str, torch.Tensor]:
    return {f"{made.name}.{name}": parameter.grad.clone() for made in models
            for name, parameter in made.adapter.named_parameters()}


def test_calls_in_a_jobs_step_leave_the_jobs_and_the_calls_as_apart():
    base, trainer, chosen, models, calls = _setup()
    alone = trainer.run_step(chosen)
    jobs_alone = _job_state(trainer)

    base, trainer, chosen, models, calls = _setup()
    outputs_alone = run_calls(base, calls, backward=True)
    gradients_alone = _gradients(models)

    base, trainer, chosen, models, calls = _setup()
    vocab, longest = int(base.lm_head.weight.shape[0]), 1 << 20
    fused = trainer.run_step(chosen, calls=FusedCalls(calls, [check_call(c, vocab, longest) for c in calls]))
    assert [(r.job, r.loss, r.tokens, r.targets) for r in fused.results] == \
        [(r.job, r.loss, r.tokens, r.targets) for r in alone.results]
    assert [r.optimizer_step is not None for r in fused.results] == [True, False]
    assert fused.tokens == alone.tokens + fused.call_tokens and fused.call_tokens == 7 + 19 + 11 + 5 + 9 + 4
    jobs_fused = _job_state(trainer)
    assert jobs_fused.keys() == jobs_alone.keys()
    assert all(torch.equal(jobs_fused[name], jobs_alone[name]) for name in jobs_alone)
    for ours, reference in zip(fused.call_outputs, outputs_alone, strict=True):
        assert ours.loss_sum == reference.loss_sum
        assert all(torch.equal(a, b) for a, b in zip(ours.logprobs, reference.logprobs, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ours.elementwise_loss, reference.elementwise_loss, strict=True))
        assert ours.metrics == reference.metrics
    assert fused.call_outputs[2].metrics["custom/a:sum"] != 0.0 and not fused.call_outputs[2].elementwise_loss
    gradients = _gradients(models)
    assert gradients.keys() == gradients_alone.keys()
    assert all(torch.equal(gradients[name], gradients_alone[name]) for name in gradients)
    assert any(gradients[name].abs().sum() > 0 for name in gradients)


def test_a_trainer_whose_stream_has_no_place_for_calls_refuses_them():
    base, _, chosen, _, calls = _setup()
    padded = FusedTrainer(base, layout="padded_fused")
    for job, _ in chosen:
        padded.add_job(job)
    assert not padded.fuses_calls
    with pytest.raises(ValueError, match="cannot share a step of layout 'padded_fused'"):
        padded.run_step(chosen, calls=FusedCalls(calls, [{} for _ in calls]))
