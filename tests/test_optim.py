"""Learning-rate schedules against transformers' reference schedules; clipping and accumulation."""

from __future__ import annotations

import pytest
import torch
from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from actors.engine.optim import JobOptimizer, lr_factor
from actors.engine.spec import JobSpec

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
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step(targets=1)
        for group in reference.param_groups:
            group["lr"] = spec.lr * lr_factor(step, schedule="cosine", warmup_steps=2, total_steps=8)
        torch.nn.utils.clip_grad_norm_(theirs, 0.5)
        reference.step()
        reference.zero_grad(set_to_none=True)
    for a, b, s in zip(ours, theirs, start):
        assert not torch.equal(a, s)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
