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
            lr, norm = opt.step()
            assert norm == pytest.approx(30.0)  # three accumulated gradients of norm 10, before clipping
    assert due == [False, False, True, False, False, True]
    assert opt.step_count == 2 and weight.grad is None
