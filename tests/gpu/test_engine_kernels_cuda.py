"""The engine's own Triton kernels on CUDA (skipped without a GPU). The flat AdamW (actors/engine/flat_adamw.py): a
pooled job's device steps against torch's AdamW in float64 within the rounding bound tests/unit/engine/
test_flat_adamw.py derives, the bfloat16 copy it writes the one `MasterPool.refresh` makes (CUDA's round-to-nearest-
even, torch's), the gradient buffer zeroed, the kernel launched once per job and step. The grouped gradients'
addition (actors/engine/lora_grad_kernel.py): a three-job layer's pooled gradients through the kernel within one
float32 rounding per addition of the torch way's. The kept stacks' copy kernel (actors/engine/lora_stacks.py): a
layer whose masters change between steps gives, through its kept stacks, the output of a layer stacking afresh, bit
for bit."""

from __future__ import annotations

import pytest
import torch

from actors.engine import flat_adamw, lora_cuda, lora_grad_kernel, lora_grouped_mm, lora_stacks
from actors.engine.adapter_surgery import pool_masters
from actors.engine.joint_steps import step_jobs
from actors.engine.layout import StepLayout, step_layout
from tests.helpers.flat_adamw_jobs import (
    add_gradients,
    assert_within_adamw_rounding,
    pooled_job,
    reference_of,
    reference_step,
    spec,
)
from tests.helpers.lora_bounds import BOUNDS, IN, OUT, bf16_values, fused_layer, layout_of, pooled_layer
from tests.helpers.tolerances import unit_roundoff

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or flat_adamw.triton is None,
                                reason="needs a CUDA GPU and Triton")


@pytest.mark.parametrize("overrides", [{}, {"lora": {"loraplus_lr_ratio": 4.0}}, {"max_grad_norm": None}],
                         ids=["clipped", "lora+", "unclipped"])
def test_the_kernel_on_cuda_steps_as_torch_s_adamw(monkeypatch, overrides):
    optimizer, adapters = pooled_job(spec(**overrides), seed=21, rank=16, device="cuda")
    pool = optimizer.flat.pool
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    assert flat_adamw.kernel_works(torch.device("cuda"))   # its once-a-device check passes (and is not counted)
    launches = []
    real = flat_adamw._adamw_kernel.run
    monkeypatch.setattr(flat_adamw._adamw_kernel, "run", lambda *a, **k: launches.append(1) or real(*a, **k))
    copies, reference = reference_of(optimizer)
    generator = torch.Generator().manual_seed(9)
    for step, targets in enumerate((3, 1, 6, 2)):
        grads = add_gradients(optimizer, generator)
        expected_norm = reference_step(optimizer, copies, reference, grads, targets)
        [(_, norm)] = step_jobs([optimizer], [targets], on_device=True)
        assert float(norm) == pytest.approx(expected_norm, rel=1e-5)
        assert_within_adamw_rounding(optimizer, copies, step + 1)
    assert len(launches) == 4
    assert not bool(pool.grads.values.any())
    written = pool.casts[torch.bfloat16].clone()
    pool.current.clear()
    pool.refresh(StepLayout((), (), 0), torch.bfloat16)
    assert torch.equal(pool.casts[torch.bfloat16], written)


def test_the_grouped_gradients_kernel_on_cuda_adds_as_the_torch_way(monkeypatch):
    device = torch.device("cuda")
    if not lora_grouped_mm.grouped_mm_works(device):
        pytest.skip("torch._grouped_mm does not work on this GPU (logged); the path takes segments here")
    assert lora_grad_kernel.kernel_works(device)
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    launched = []
    real = lora_grad_kernel._add_groups_kernel.run
    monkeypatch.setattr(lora_grad_kernel._add_groups_kernel, "run",
                        lambda *a, **k: launched.append(1) or real(*a, **k))
    x, upstream = bf16_values(1, 57, IN).cuda(), bf16_values(1, 57, OUT).cuda()
    layers = {}
    for kernel in (True, False):
        monkeypatch.setattr(lora_grad_kernel, "kernel_works", (lambda d: True) if kernel else (lambda d: False))
        layer = fused_layer(ranks=(8, 8, 8), device="cuda")
        for adapter in layer.adapters.values():
            pool_masters([adapter], device)
        with step_layout(layout_of(BOUNDS)):
            out = layer(x.clone().requires_grad_(True))
        (out.float() * upstream.float()).sum().backward()
        layers[kernel] = layer
    assert len(launched) == 1   # the A and the B stack in one launch
    for name in layers[True].adapters:
        for attribute in ("lora_A", "lora_B"):
            mine = getattr(layers[True].adapters[name], attribute).grad
            theirs = getattr(layers[False].adapters[name], attribute).grad
            assert float((mine - theirs).abs().max()) <= 2 * 2 * unit_roundoff() * float(theirs.abs().max())


def test_kept_stacks_refreshed_on_cuda_match_fresh_ones(monkeypatch):
    device = torch.device("cuda")
    if not lora_grouped_mm.grouped_mm_works(device):
        pytest.skip("torch._grouped_mm does not work on this GPU (logged); the path takes segments here")
    assert lora_stacks.CHECK.works(device)
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    launched = []
    real = lora_stacks._copy_slots_kernel.run
    monkeypatch.setattr(lora_stacks._copy_slots_kernel, "run", lambda *a, **k: launched.append(1) or real(*a, **k))

    def forward(layer):
        with torch.no_grad(), step_layout(layout_of(BOUNDS)):
            return layer(x)

    x = bf16_values(1, 57, IN).cuda()
    layer = pooled_layer(device="cuda")
    forward(layer)
    for step in range(2):
        with torch.no_grad():
            for adapter in layer.adapters.values():
                adapter.lora_A.add_(0.5)
                adapter.lora_B.mul_(0.75)
        assert torch.equal(forward(layer), forward(pooled_layer(device="cuda", like=layer))), step
    assert len(launched) == 2
