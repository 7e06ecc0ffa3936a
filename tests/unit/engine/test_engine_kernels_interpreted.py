"""The engine's own Triton kernels on the CPU under Triton's interpreter, each against its torch reference: the flat
AdamW (actors/engine/flat_adamw.py `_adamw_kernel` against `reference_update`, which tests/unit/engine/
test_flat_adamw.py holds to torch's AdamW), the grouped gradients' addition (actors/engine/lora_grad_kernel.py,
against `add_groups_reference`, which tests/unit/engine/test_lora_gradient_pool.py holds to autograd bit for bit),
the kept stacks' copy (actors/engine/lora_stacks.py), and the whole engine on the three kernels: jobs joining, leaving
and accumulating each end as alone (tests/unit/engine/test_cuda_path_engine.py's, there on the torch references).

This module runs in a process started with TRITON_INTERPRET=1 (test_lora_grad_kernel.py starts it; Triton's functions
are made interpreted when triton is first imported) and skips itself elsewhere.

The flat AdamW. The two compute the same float32
expressions in the same order, but a compiler may contract a product and a sum into one rounding (a fused
multiply-add): per step, each of the update's `ADAMW_ROUNDINGS` roundings may differ by u (2^-24) of the weight or of
the update, for the moments likewise (of their largest: a moment sums terms of both signs), so over k steps the
weights agree within 2·k·ADAMW_ROUNDINGS·u·(|w| + lr).
The compute-dtype copy the kernel writes is the one `MasterPool.refresh` makes from the kernel's masters, bit for bit
(float32 B times the scaling, rounded to bfloat16 to nearest even, as torch rounds and compiled Triton does; the
interpreter, which truncates, is made to round so: tests/helpers/triton_interpreter.py)."""

from __future__ import annotations

import os

import numpy
import pytest
import torch

from actors.engine import flat_adamw, lora_cuda, lora_grad_kernel, lora_stacks
from actors.engine.adapter_surgery import pool_masters
from actors.engine.joint_steps import step_jobs
from actors.engine.layout import StepLayout, step_layout
from tests.helpers.cuda_path_runs import assert_as_alone, on_the_cuda_path, planned_jobs, run_planned
from tests.helpers.flat_adamw_jobs import add_gradients, pooled_job, spec
from tests.helpers.isolation import base_for
from tests.helpers.lora_bounds import BOUNDS, IN, OUT, bf16_values, fused_layer, layout_of, pooled_layer
from tests.helpers.tolerances import ADAMW_ROUNDINGS, unit_roundoff
from tests.helpers.triton_interpreter import bfloat16_rounded_as_compiled

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or flat_adamw.triton is None,
                                reason="needs Triton's interpreter on from the process's start (TRITON_INTERPRET=1): "
                                       "tests/unit/engine/test_lora_grad_kernel.py runs it so")


def as_float32_scalars(arguments: tuple) -> tuple:
    """A launch's float scalars as CUDA's compiled kernel takes them (float32; the interpreter keeps Python's
    doubles): arithmetic on scalars inside a kernel (1 - beta2 from a rounded beta2: 1.3e-5 off) shows here too."""
    return tuple(float(numpy.float32(value)) if isinstance(value, float) else value for value in arguments)


def _trained(kernel: bool, monkeypatch, overrides: dict) -> tuple:
    monkeypatch.setattr(flat_adamw, "kernel_runs", (lambda device: True) if kernel else (lambda device: False))
    optimizer, adapters = pooled_job(spec(**overrides), seed=11, rank=8)
    pool = optimizer.flat.pool
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    launches = []
    if kernel:
        assert flat_adamw.kernel_works(torch.device("cpu"))   # its once-a-device check passes here too
        real = flat_adamw._adamw_kernel.run
        monkeypatch.setattr(flat_adamw._adamw_kernel, "run",
                            lambda *a, **k: launches.append(1) or real(*as_float32_scalars(a), **k))
    generator = torch.Generator().manual_seed(7)
    for targets in (3, 1, 6):
        add_gradients(optimizer, generator)
        step_jobs([optimizer], [targets], on_device=True)
    assert not kernel or len(launches) == 3
    return optimizer, pool, adapters


@pytest.mark.parametrize("overrides", [{}, {"lora": {"loraplus_lr_ratio": 4.0}}, {"max_grad_norm": None}],
                         ids=["clipped", "lora+", "unclipped"])
def test_the_kernel_steps_as_its_reference(monkeypatch, overrides):
    kernel, kernel_pool, _ = _trained(True, monkeypatch, overrides)
    reference, reference_pool, _ = _trained(False, monkeypatch, overrides)
    lr = kernel.spec.lr * max(group["lr_ratio"] for group in kernel.optimizer.param_groups)
    bound = 2 * 3 * ADAMW_ROUNDINGS * unit_roundoff() * (reference_pool.flat.abs() + lr)
    assert bool(((kernel_pool.flat - reference_pool.flat).abs() <= bound).all())
    untrained, adapters = pooled_job(spec(**overrides), seed=11, rank=8)
    assert not torch.equal(kernel_pool.flat, untrained.flat.pool.flat)
    for mine, theirs in ((kernel.flat.exp_avg, reference.flat.exp_avg),
                         (kernel.flat.exp_avg_sq, reference.flat.exp_avg_sq)):
        # a moment sums terms of both signs: its rounding is of its terms' size, at most the largest moment's
        bound = 2 * 3 * ADAMW_ROUNDINGS * unit_roundoff() * float(theirs.abs().max())
        assert float((mine - theirs).abs().max()) <= bound
    assert not bool(kernel_pool.grads.values.any())
    assert kernel.flat.steps == 3 and {float(s["step"]) for s in kernel.state_dict()["optimizer"]["state"].values()} \
        == {3.0}


def test_the_kernel_s_copy_is_the_refresh_s(monkeypatch):
    bfloat16_rounded_as_compiled()   # the interpreter's gap (tests/helpers/triton_interpreter.py)
    _, pool, _ = _trained(True, monkeypatch, {})
    written = pool.casts[torch.bfloat16].clone()
    pool.current.clear()
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    assert torch.equal(pool.casts[torch.bfloat16], written)


def test_the_grouped_gradients_kernel_adds_as_its_reference(monkeypatch):
    """A three-job layer of rank 8 on grouped_mm (the path's bfloat16 run on this CPU), backward twice (the second
    adds into the first's gradients): through the kernel, every job's pooled gradients within one float32 rounding
    per addition of the same layer's through the torch way (a product and a sum each time: 2u of the largest
    gradient per backward, the compiler free to contract them); a job outside the second step's groups untouched."""
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    assert lora_grad_kernel.kernel_works(torch.device("cpu"))
    launched = []
    real = lora_grad_kernel._add_groups_kernel.run
    monkeypatch.setattr(lora_grad_kernel._add_groups_kernel, "run",
                        lambda *a, **k: launched.append(1) or real(*a, **k))
    layers = {}
    for kernel in (True, False):
        monkeypatch.setattr(lora_grad_kernel, "kernel_works", (lambda device: True) if kernel else (lambda d: False))
        layer = fused_layer(ranks=(8, 8, 8))
        for adapter in layer.adapters.values():
            pool_masters([adapter], torch.device("cpu"))
        torch.manual_seed(3)
        for bounds, names in ((BOUNDS, None), (((0, 9), (9, 30)), ["job2", "job0"])):
            x = bf16_values(1, bounds[-1][1], IN).requires_grad_(True)
            upstream = bf16_values(1, bounds[-1][1], OUT)
            with step_layout(layout_of(bounds, names)):
                out = layer(x)
            (out.float() * upstream.float()).sum().backward()
        layers[kernel] = layer
    assert len(launched) == 2   # one a backward pass: its A and its B stack together
    for name in layers[True].adapters:
        for attribute in ("lora_A", "lora_B"):
            mine = getattr(layers[True].adapters[name], attribute).grad
            theirs = getattr(layers[False].adapters[name], attribute).grad
            bound = 2 * 2 * 2 * unit_roundoff() * float(theirs.abs().max())
            assert float((mine - theirs).abs().max()) <= bound, (name, attribute)
    assert not torch.equal(layers[True].adapters["job1"].lora_A.grad, torch.zeros_like(
        layers[True].adapters["job1"].lora_A.grad))


def test_the_stacks_copy_kernel_refreshes_kept_stacks_as_fresh_ones(monkeypatch):
    """A three-job layer of rank 8 on grouped_mm, its masters changed between steps: its kept stacks, refreshed by the
    copy kernel (one launch a step), give the same output bit for bit as a layer that stacks afresh."""
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    assert lora_stacks.CHECK.works(torch.device("cpu"))
    launched = []
    real = lora_stacks._copy_slots_kernel.run
    monkeypatch.setattr(lora_stacks._copy_slots_kernel, "run", lambda *a, **k: launched.append(1) or real(*a, **k))

    def forward(layer):
        with torch.no_grad(), step_layout(layout_of()):
            return layer(x)

    x = bf16_values(1, 57, IN)
    layer = pooled_layer()
    forward(layer)
    for step in range(2):
        with torch.no_grad():
            for adapter in layer.adapters.values():
                adapter.lora_A.add_(0.5)
                adapter.lora_B.mul_(0.75)
        ours = forward(layer)
        assert torch.equal(ours, forward(pooled_layer(like=layer))), step
    assert len(launched) == 2


def test_the_engine_on_its_kernels_keeps_jobs_joining_and_leaving_as_alone(monkeypatch):
    """tests/unit/engine/test_cuda_path_engine.py's jobs (joining, leaving once done, accumulating) through the whole
    engine on grouped_mm in bfloat16, with the three kernels doing their work: the flat AdamW, the grouped gradients'
    addition and the kept stacks' copy. Each job ends bit for bit as it does alone through the same kernels (each
    computes a job's values from that job's own alone), and each kernel ran."""
    bfloat16_rounded_as_compiled()   # the interpreter's gap (tests/helpers/triton_interpreter.py)
    cpu = torch.device("cpu")
    assert flat_adamw.kernel_works(cpu) and lora_grad_kernel.kernel_works(cpu) and lora_stacks.CHECK.works(cpu)
    launched = {"adamw": 0, "gradients": 0, "stacks": 0}
    for name, kernel in (("adamw", flat_adamw._adamw_kernel), ("gradients", lora_grad_kernel._add_groups_kernel),
                         ("stacks", lora_stacks._copy_slots_kernel)):
        def counted(*args, name=name, run=kernel.run, **options):
            launched[name] += 1
            return run(*args, **options)

        monkeypatch.setattr(kernel, "run", counted)
    calls = on_the_cuda_path(monkeypatch, "grouped_mm")
    base = base_for("bfloat16")
    planned = planned_jobs()
    fused_weights, fused_losses, _ = run_planned(base, planned)
    assert calls.flat_updates == sum(job.spec.max_steps for job in planned) == launched["adamw"]
    assert launched["gradients"] > 0 and launched["stacks"] > 0 and calls.kept_stacks > 0, launched
    assert_as_alone(base, planned, fused_weights, fused_losses)


def test_layers_sharing_an_input_on_the_kernels_end_each_job_as_alone(monkeypatch):
    """tests/unit/engine/test_lora_siblings.py's engine run (jobs of one rank on every layer, one joining later, one
    accumulating) with q, k and v, and gate and up, computed together (actors/engine/lora_siblings.py) and the
    kernels doing their work: the gradients of each set added by one launch into the jobs' buffers through blocks of
    the stacks, the sets' block-diagonal stacks refreshed through the copy kernel's strided slots. Each job ends bit
    for bit as it does alone through the same kernels."""
    from actors.engine import lora_siblings
    from tests.helpers.cuda_path_runs import one_rank_jobs

    bfloat16_rounded_as_compiled()
    cpu = torch.device("cpu")
    assert lora_grad_kernel.kernel_works(cpu) and lora_stacks.CHECK.works(cpu)
    launched = {"gradients": 0, "stacks": 0, "together": 0}
    for name, kernel in (("gradients", lora_grad_kernel._add_groups_kernel),
                         ("stacks", lora_stacks._copy_slots_kernel)):
        def counted(*args, name=name, run=kernel.run, **options):
            launched[name] += 1
            return run(*args, **options)

        monkeypatch.setattr(kernel, "run", counted)
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    real = lora_siblings._SiblingLinears.apply
    monkeypatch.setattr(lora_siblings._SiblingLinears, "apply",
                        lambda *a: launched.__setitem__("together", launched["together"] + 1) or real(*a))
    on_the_cuda_path(monkeypatch, "grouped_mm")
    base = base_for("bfloat16")
    planned = one_rank_jobs(examples=8)
    fused_weights, fused_losses, _ = run_planned(base, planned)
    assert launched["gradients"] > 0 and launched["stacks"] > 0 and launched["together"] > 0, launched
    assert_as_alone(base, planned, fused_weights, fused_losses)


def test_a_backwards_layers_are_added_by_one_launch_and_a_layer_twice_by_two(monkeypatch):
    """A tiny Llama's every adapted layer of two jobs on grouped_mm: their stacked gradients are queued and added at
    the backward's end by one launch, within one float32 rounding per addition of the torch way's (as
    test_the_grouped_gradients_kernel_adds_as_its_reference bounds it); a layer used twice in one forward adds its
    second stacks in a launch of their own (one launch never adds twice into one buffer)."""
    from actors.engine.adapter_surgery import add_adapter
    from actors.engine.models import from_module
    from actors.spec.lora_config import LoraConfig
    from tests.helpers.models import tiny_model

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    launched = []
    real = lora_grad_kernel._add_groups_kernel.run
    monkeypatch.setattr(lora_grad_kernel._add_groups_kernel, "run", lambda *a, **k: launched.append(1) or real(*a, **k))
    ids = torch.randint(3, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    grads = {}
    for kernel in (True, False):
        monkeypatch.setattr(lora_grad_kernel, "kernel_works", (lambda device: True) if kernel else (lambda d: False))
        torch.manual_seed(0)
        base = from_module(tiny_model("llama", 300).to(torch.bfloat16), None)
        handles = [add_adapter(base.model, f"job{index}", LoraConfig(r=8, alpha=16, target_modules="all-linear"),
                               seed=index) for index in range(2)]
        with torch.no_grad():
            for handle in handles:
                for name, parameter in handle.named_parameters():
                    if "lora_B" in name:
                        parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(len(name)))
        with step_layout(layout_of(((0, 12), (12, 30)), ["job0", "job1"])):
            hidden = base.decoder(input_ids=ids, position_ids=torch.arange(30)[None], use_cache=False).last_hidden_state
        hidden.float().square().sum().backward()
        grads[kernel] = {(h.name, n): p.grad.clone() for h in handles for n, p in h.named_parameters()}
    assert len(launched) == 1
    for key, theirs in grads[False].items():
        assert float(theirs.abs().max()) > 0, key
        bound = 2 * unit_roundoff() * float(theirs.abs().max())   # a product and a sum, each rounded once
        assert float((grads[True][key] - theirs).abs().max()) <= bound, key
    launched.clear()
    monkeypatch.setattr(lora_grad_kernel, "kernel_works", lambda device: True)
    layer = pooled_layer()
    x = bf16_values(1, 57, IN).requires_grad_(True)
    with step_layout(layout_of()):
        twice = layer(x) + layer(x)
    twice.float().sum().backward()
    assert len(launched) == 2
