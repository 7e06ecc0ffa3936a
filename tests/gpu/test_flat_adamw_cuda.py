"""The flat AdamW's Triton kernel on CUDA (actors/engine/flat_adamw.py; skipped without a GPU): a pooled job's device
steps against torch's AdamW in float64 within the rounding bound tests/unit/engine/test_flat_adamw.py derives, the
bfloat16 copy it writes the one `MasterPool.refresh` makes (CUDA's round-to-nearest-even, torch's), the gradient
buffer zeroed, and the kernel launched once per job and step."""

from __future__ import annotations

import pytest
import torch

from actors.engine import flat_adamw
from actors.engine.optim import step_jobs
from tests.helpers.flat_adamw_jobs import (
    add_gradients,
    assert_within_adamw_rounding,
    pooled_job,
    reference_of,
    reference_step,
    spec,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or flat_adamw.triton is None,
                                reason="needs a CUDA GPU and Triton")


@pytest.mark.parametrize("overrides", [{}, {"lora": {"loraplus_lr_ratio": 4.0}}, {"max_grad_norm": None}],
                         ids=["clipped", "lora+", "unclipped"])
def test_the_kernel_on_cuda_steps_as_torch_s_adamw(monkeypatch, overrides):
    optimizer, adapters = pooled_job(spec(**overrides), seed=21, rank=16, device="cuda")
    pool = optimizer.flat.pool
    pool.refresh(object(), torch.bfloat16)
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
    assert not bool(pool.grad_flat.any())
    written = pool.casts[torch.bfloat16].clone()
    pool.current.clear()
    pool.refresh(object(), torch.bfloat16)
    assert torch.equal(pool.casts[torch.bfloat16], written)
