"""Learning-rate schedules against transformers' reference schedules; clipping and accumulation."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from actors.engine.optim import JobOptimizer, lr_factor
from actors.spec.job_spec import JobSpec

REFERENCES = {"constant": lambda opt, w, t: get_constant_schedule_with_warmup(opt, w),
              "linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules_match_transformers(schedule):
    warmup, total = 5, 40
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = REFERENCES[schedule](optimizer, warmup, total)
    for step in range(total):
        expected = reference.get_last_lr()[0]
        # transformers' warm-up starts at 0 (step 0 gets lr 0); ours takes the first step at lr/warmup
        if step < warmup:
            expected = (step + 1) / warmup
        assert lr_factor(step, schedule=schedule, warmup_steps=warmup, total_steps=total) == pytest.approx(expected,
                                                                                                            abs=1e-9)
        optimizer.step()
        reference.step()


def test_accumulation_steps_every_grad_accum_micro_batches_and_clips():
    spec = JobSpec(name="a", data="x", format={"type": "text"}, grad_accum=3, max_grad_norm=0.5, lr=0.1,
                   lr_schedule="constant")
    weight = torch.nn.Parameter(torch.zeros(4))
    opt = JobOptimizer(spec, [weight], total_steps=10)
    due = []
    for _ in range(6):
        (weight * torch.tensor([10.0, 0, 0, 0])).sum().backward()
        due.append(opt.micro_step_done())
        if due[-1]:
            lr, norm = opt.step(targets=3)
            assert norm == pytest.approx(10.0)  # three summed gradients of norm 10 over 3 targets, before clipping
    assert due == [False, False, True, False, False, True]
    assert opt.step_count == 2 and weight.grad is None


def test_job_optimizer_steps_like_torch_reference_adamw():
    """The fused AdamW kernel (used on the CPU and CUDA) moves an adapter-like set of parameters as torch's
    plain per-parameter AdamW does, with the warm-up/cosine schedule and clipping applied to both."""
    spec = JobSpec(name="a", data="x", format={"type": "text"}, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5,
                   lr_schedule="cosine", warmup_steps=2)
    torch.manual_seed(0)
    start = [torch.randn(4, 16), torch.randn(16, 4) * 0.1, torch.randn(4, 32)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = JobOptimizer(spec, ours, total_steps=8)
    assert opt.optimizer.defaults["fused"] is True
    reference = torch.optim.AdamW(theirs, lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)
    for step in range(8):
        grads = [torch.randn_like(t) for t in start]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        opt.step(targets=1)
        for group in reference.param_groups:
            group["lr"] = spec.lr * lr_factor(step, schedule="cosine", warmup_steps=2, total_steps=8)
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        reference.step()
        reference.zero_grad(set_to_none=True)
    for a, b, s in zip(ours, theirs, start, strict=True):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _jobs_with_gradients(seed: int, specs: list[JobSpec], loss_scaling: list[bool] | None = None):
    """One JobOptimizer per spec over a few parameters of assorted shapes, with random gradients."""
    generator = torch.Generator().manual_seed(seed)
    optimizers = []
    for index, spec in enumerate(specs):
        parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator))
                      for shape in ((4, 8), (8, 4), (3, 5))[: 2 + index % 2]]
        optimizers.append(JobOptimizer(spec, parameters, total_steps=10,
                                       loss_scaling=bool(loss_scaling and loss_scaling[index])))
    return optimizers, generator


def _set_gradients(optimizers, generator, scale: float) -> None:
    for optimizer in optimizers:
        for parameter in optimizer.parameters:
            parameter.grad = torch.randn(parameter.shape, generator=generator) * scale


def test_jobs_stepped_together_equal_their_own_steps_and_each_other_alone():
    """`step_jobs` (the trainer's batched optimizer step) against each job's `JobOptimizer.step` (torch's
    clip_grad_norm_ and AdamW): the same lr, the same norm and weights to float32 rounding of the norm
    (summed in float64, another order); a loss-scaled job takes its own step. And a job stepped beside others
    ends bit for bit where it ends stepped alone (isolation)."""
    from actors.engine.joint_steps import step_jobs

    def spec(name, **overrides):
        fields = dict(name=name, data="x", format={"type": "text"}, lr=0.05, lr_schedule="cosine", warmup_steps=1,
                      max_grad_norm=1.0)
        return JobSpec(**{**fields, **overrides})

    specs = [spec("a"), spec("b", max_grad_norm=None), spec("c", lr=0.01, weight_decay=0.1), spec("d"),
             spec("e", max_grad_norm=100.0)]
    scaled = [False, False, False, True, False]
    together, gen_together = _jobs_with_gradients(0, specs, scaled)
    alone, gen_alone = _jobs_with_gradients(0, specs, scaled)
    single = [_jobs_with_gradients(0, specs, scaled)[0][index] for index in range(len(specs))]
    for step in range(3):
        _set_gradients(together, gen_together, scale=3.0)
        _set_gradients(alone, gen_alone, scale=3.0)
        for job, reference in zip(single, alone, strict=True):
            for parameter, source in zip(job.parameters, reference.parameters, strict=True):
                parameter.grad = source.grad.clone()
        targets = [5, 7, 1, 4, 9]
        batched = step_jobs(together, targets)
        own = [optimizer.step(count) for optimizer, count in zip(alone, targets, strict=True)]
        by_itself = [step_jobs([job], [count])[0] for job, count in zip(single, targets, strict=True)]
        for index, ((lr, norm), (lr_own, norm_own)) in enumerate(zip(batched, own, strict=True)):
            assert lr == lr_own and norm == pytest.approx(norm_own, rel=1e-6), (step, index)
            for p, q, r in zip(together[index].parameters, alone[index].parameters, single[index].parameters,
                               strict=True):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
                assert torch.equal(p, r), (step, index)
            assert by_itself[index] == batched[index]
