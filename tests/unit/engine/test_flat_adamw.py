"""The one-pass AdamW over a job's pooled adapter (actors/engine/flat_adamw.py), as the trainer's device step takes it
(`step_jobs(..., on_device=True)`), run here by its torch reference (`reference_update`; the Triton kernel itself
under Triton's interpreter in tests/unit/engine/test_engine_kernels_interpreted.py, on CUDA in tests/gpu/).

The reference every check is held to is torch's own AdamW in float64 over unpooled copies of the same parameters, fed
the same gradients divided by the step's target tokens and clipped by torch's `clip_grad_norm_`. Bound: each step
rounds a float32 weight `ADAMW_ROUNDINGS` times (the moments, their corrections, the square root, + eps, the
division, times lr, the subtraction: tests/helpers/tolerances.py), each by at most u (2^-24) of the weight or of the
update (at most lr), and a step's error carries into the next one's weight: after k steps at most
k * ADAMW_ROUNDINGS * u * (|w| + lr) per entry; doubled for the moments' own rounding carried into later updates
(the update m/sqrt(v) is a ratio of two moments of the same gradients: their relative errors, at most k·2u each,
move it by at most that relative amount, times lr). The clip factor's own rounding (the norm's sum over n entries,
relative γ(n)) scales the whole gradient, and AdamW's update does not change under such a scaling except through
eps (1e-8), against gradients of order 1 here: negligible beside the bound."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine import flat_adamw
from actors.engine.joint_steps import step_jobs
from actors.engine.layout import StepLayout
from actors.engine.optim import JobOptimizer
from tests.helpers.flat_adamw_jobs import (
    add_gradients,
    assert_within_adamw_rounding,
    pooled_job,
    reference_of,
    reference_step,
    spec,
)


@pytest.fixture(autouse=True)
def _reference_kernel(monkeypatch):
    """This process runs the reference (Triton's interpreter, if on, belongs to the interpreted module)."""
    monkeypatch.setattr(flat_adamw, "kernel_runs", lambda device: False)


@pytest.mark.parametrize("overrides", [{}, {"max_grad_norm": None}, {"max_grad_norm": 100.0},
                                       {"lora": {"loraplus_lr_ratio": 4.0}}, {"weight_decay": 0.0}],
                         ids=["clipped", "unclipped", "clip-inactive", "lora+", "no-decay"])
def test_the_flat_step_moves_weights_as_torch_s_adamw(overrides):
    """Four device steps of a pooled job against torch's AdamW in float64 (the schedule, the division by the
    target tokens, clipping, LoRA+'s two learning rates): within the AdamW rounding bound, the norms to float32's."""
    optimizer, _ = pooled_job(spec(**overrides), seed=1)
    assert optimizer.flat is not None
    copies, reference = reference_of(optimizer)
    generator = torch.Generator().manual_seed(0)
    for step, targets in enumerate((3, 5, 1, 7)):
        grads = add_gradients(optimizer, generator)
        expected_norm = reference_step(optimizer, copies, reference, grads, targets)
        [(lr, norm)] = step_jobs([optimizer], [targets], on_device=True)
        assert isinstance(norm, torch.Tensor)
        assert float(norm) == pytest.approx(expected_norm, rel=1e-5)
        assert all(p.grad is None for p in optimizer.parameters)
        assert_within_adamw_rounding(optimizer, copies, step + 1)
    assert optimizer.step_count == 4


def test_the_step_writes_the_compute_copy_and_clears_the_gradients():
    """The step's copy in bfloat16 is the one `MasterPool.refresh` makes from the new masters, bit for bit (B times
    the scaling); the buffer is zeroed, so the next backward attaches it without a fill."""
    optimizer, _ = pooled_job(spec(), seed=2)
    pool = optimizer.flat.pool
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    add_gradients(optimizer, torch.Generator().manual_seed(1))
    step_jobs([optimizer], [4], on_device=True)
    written = pool.casts[torch.bfloat16].clone()
    generation = pool.generation
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)   # a new step: nothing to cast again
    assert pool.generation == generation and torch.equal(pool.casts[torch.bfloat16], written)
    fresh = copy.deepcopy(pool)
    fresh.current.clear()
    fresh.refresh(StepLayout((), (), 0), torch.bfloat16)
    assert torch.equal(fresh.casts[torch.bfloat16], written)
    assert pool.grads.zeroed and not bool(pool.grads.values.any())
    fills = []
    real_zero = torch.Tensor.zero_
    try:
        torch.Tensor.zero_ = lambda self: fills.append(self) or real_zero(self)
        pool.grads.attach()
    finally:
        torch.Tensor.zero_ = real_zero
    assert fills == [] and all(p.grad is not None and not bool(p.grad.any()) for p in optimizer.parameters)


def test_a_changed_master_is_cast_again():
    """A master changed after the step (a load) is cast again at the next refresh: the step's copy is current only
    at the version it was written at."""
    optimizer, adapters = pooled_job(spec(), seed=3)
    pool = optimizer.flat.pool
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    add_gradients(optimizer, torch.Generator().manual_seed(2))
    step_jobs([optimizer], [2], on_device=True)
    with torch.no_grad():
        adapters[0].lora_A.fill_(0.25)
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    a = pool.weights(adapters[0], *pool_start(adapters[0]), torch.bfloat16)[0]
    assert bool((a == 0.25).all())


def pool_start(adapter) -> tuple[int, int]:
    return adapter.master_pool[1], adapter.master_pool[2]


def test_torch_s_state_dict_reads_the_flat_state_and_a_loaded_state_is_adopted():
    """After flat steps, the job's state_dict is torch's: per parameter its moments and a step count of the steps
    taken. Loaded into a job stepped by torch's AdamW (unpooled) and into another pooled job, both go on as one:
    three more steps each, the same weights within the rounding bound of their common float64 reference."""
    optimizer, _ = pooled_job(spec(), seed=4)
    copies, reference = reference_of(optimizer)
    generator = torch.Generator().manual_seed(3)
    for targets in (2, 3):
        grads = add_gradients(optimizer, generator)
        reference_step(optimizer, copies, reference, grads, targets)
        step_jobs([optimizer], [targets], on_device=True)
    state = optimizer.state_dict()
    entries = state["optimizer"]["state"]
    assert len(entries) == len(optimizer.parameters)
    assert {float(entry["step"]) for entry in entries.values()} == {2.0}
    flat = optimizer.flat
    assert torch.equal(entries[0]["exp_avg"], flat._view(flat.exp_avg, optimizer.parameters[0]))

    pooled, _ = pooled_job(spec(), seed=4)
    unpooled = JobOptimizer(spec(), [torch.nn.Parameter(p.detach().clone()) for p in optimizer.parameters], 6)
    for other in (pooled, unpooled):
        with torch.no_grad():
            for mine, theirs in zip(other.parameters, optimizer.parameters, strict=True):
                mine.copy_(theirs)
        other.load_state_dict(copy.deepcopy(state))
    for targets in (4, 1, 5):
        grads = add_gradients(optimizer, generator)
        reference_step(optimizer, copies, reference, grads, targets)
        for other in (pooled, unpooled):
            if other is pooled:
                other.flat.pool.grads.attach()
            else:
                for parameter in other.parameters:
                    parameter.grad = torch.zeros_like(parameter)
            with torch.no_grad():
                for parameter, grad in zip(other.parameters, grads, strict=True):
                    parameter.grad.add_(grad)
        step_jobs([optimizer, pooled], [targets, targets], on_device=True)
        unpooled.step(targets)
    for other in (optimizer, pooled, unpooled):
        assert_within_adamw_rounding(other, copies, 5)
    assert pooled.flat.steps == 5


def test_a_step_by_torch_s_adamw_between_flat_steps_keeps_the_count():
    """A pooled job whose gradients are not its buffer's views at a step (set by hand: a loaded gradient) takes
    torch's AdamW over the same state; the flat step after it adopts the state with its count (bias corrections
    of step 3, not 2)."""
    optimizer, _ = pooled_job(spec(), seed=5)
    copies, reference = reference_of(optimizer)
    generator = torch.Generator().manual_seed(4)
    for step in range(3):
        if step == 1:
            grads = [torch.randn(p.shape, generator=generator) * 3.0 for p in optimizer.parameters]
            for parameter, grad in zip(optimizer.parameters, grads, strict=True):
                parameter.grad = grad.clone()
        else:
            grads = add_gradients(optimizer, generator)
        reference_step(optimizer, copies, reference, grads, 2)
        step_jobs([optimizer], [2], on_device=True)
    assert optimizer.flat.steps == 3
    assert_within_adamw_rounding(optimizer, copies, 3)


def test_a_job_s_nan_stays_in_that_job():
    """Jobs stepped together: one job's NaN gradient poisons its own weights only; the other ends bit for bit where
    it ends stepped alone."""
    jobs = [pooled_job(spec("a"), seed=6), pooled_job(spec("b", lr=0.01), seed=7), pooled_job(spec("b", lr=0.01),
                                                                                            seed=7)]
    together, alone = [jobs[0][0], jobs[1][0]], jobs[2][0]   # (the adapters, which hold the pools, kept in `jobs`)
    generator = torch.Generator().manual_seed(5)
    grads = add_gradients(together[1], generator)
    alone.flat.pool.grads.attach()
    with torch.no_grad():
        for parameter, grad in zip(alone.parameters, grads, strict=True):
            parameter.grad.add_(grad)
    add_gradients(together[0], generator)
    with torch.no_grad():
        together[0].parameters[0].grad[0, 0] = float("nan")
    step_jobs(together, [3, 3], on_device=True)
    step_jobs([alone], [3], on_device=True)
    assert bool(together[0].parameters[0].isnan().any())
    for mine, theirs in zip(together[1].parameters, alone.parameters, strict=True):
        assert torch.equal(mine, theirs)


def test_jobs_the_flat_step_cannot_take_keep_torch_s_adamw():
    """A DoRA magnitude beside the pool, a float16 job's loss scaling, or parameters that are not a pool's: no flat
    step (torch's AdamW steps them as before)."""
    optimizer, adapters = pooled_job(spec(), seed=8)
    extra = torch.nn.Parameter(torch.ones(3))
    assert JobOptimizer(spec(), [*optimizer.parameters, extra], 6).flat is None
    assert JobOptimizer(spec(), optimizer.parameters, 6, loss_scaling=True).flat is None
    assert JobOptimizer(spec(), [torch.nn.Parameter(torch.ones(2, 2))], 6).flat is None
    assert JobOptimizer(spec(), optimizer.parameters[:2], 6).flat is None


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_a_kernel_that_fails_its_check_leaves_the_steps_to_the_reference(monkeypatch, caplog, broken):
    """The kernel is checked once per device against the reference: one that raises (a Triton that cannot compile)
    or writes nothing is logged once and the jobs step by the reference, as torch's AdamW moves them."""
    def launch(*args, **kwargs):
        if broken == "raises":
            raise RuntimeError("no compiler here")

    monkeypatch.setattr(flat_adamw, "kernel_runs", lambda device: True)
    monkeypatch.setattr(flat_adamw.CHECK, "checked", {})
    monkeypatch.setattr(flat_adamw, "_launch", launch)
    optimizer, _ = pooled_job(spec(), seed=9)
    copies, reference = reference_of(optimizer)
    generator = torch.Generator().manual_seed(8)
    for step in range(2):
        grads = add_gradients(optimizer, generator)
        reference_step(optimizer, copies, reference, grads, 3)
        step_jobs([optimizer], [3], on_device=True)
        assert_within_adamw_rounding(optimizer, copies, step + 1)
    assert flat_adamw.CHECK.checked == {"cpu": False}
    warnings = [record.getMessage() for record in caplog.records if "flat AdamW kernel" in record.getMessage()]
    assert len(warnings) == 1
    assert ("no compiler here" in warnings[0]) == (broken == "raises")


def test_updates_left_for_later_run_after_the_norms_are_read_and_step_the_same():
    """`later`: the trainer reads the norms back before the updates are launched (its read then waits for the
    backward, not the AdamW kernels). Until the updates run nothing of the job moved (weights, gradients, step count,
    schedule); the norms are already final; run, they step the job bit for bit as the step that launched them at
    once."""
    # each job with its adapters, which hold its pool
    jobs = [pooled_job(spec(), seed=3), pooled_job(spec(), seed=3)]
    now, deferred = jobs[0][0], jobs[1][0]
    for step, targets in enumerate((3, 5)):
        add_gradients(now, torch.Generator().manual_seed(step))
        add_gradients(deferred, torch.Generator().manual_seed(step))
        before = [p.detach().clone() for p in deferred.parameters]
        gradients = [p.grad.clone() for p in deferred.parameters]
        lr, count = deferred.lr, deferred.step_count
        later = []
        [(lr_later, norm_later)] = step_jobs([deferred], [targets], on_device=True, later=later)
        assert len(later) == 1
        assert all(torch.equal(p, q) for p, q in zip(deferred.parameters, before, strict=True))
        assert all(torch.equal(p.grad, g) for p, g in zip(deferred.parameters, gradients, strict=True))
        assert (deferred.lr, deferred.step_count) == (lr, count)
        [(lr_now, norm_now)] = step_jobs([now], [targets], on_device=True)
        assert lr_later == lr_now and torch.equal(norm_later, norm_now)
        later[0]()
        assert all(p.grad is None for p in deferred.parameters) and deferred.step_count == now.step_count == step + 1
        assert all(torch.equal(p, q) for p, q in zip(deferred.parameters, now.parameters, strict=True))
