"""The grouped gradients' addition into the jobs' pooled buffers (actors/engine/lora_grad_kernel.py): its failure path
here (a kernel that raises or disagrees at its once-a-device check is logged once, and the layers add their gradients
the torch way, bit for bit as autograd's), and the engine's Triton kernels under Triton's interpreter, in a process of
their own (tests/unit/engine/test_engine_kernels_interpreted.py). Its torch way against autograd:
tests/unit/engine/test_lora_gradient_pool.py; on CUDA: tests/gpu/test_flat_adamw_cuda.py."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from actors.engine import lora_cuda, lora_grad_kernel
from actors.engine.adapter_surgery import pool_masters
from actors.engine.layout import step_layout
from tests.helpers.lora_bounds import IN, OUT, bf16_values, fused_layer, layout_of
from tests.helpers.triton_interpreter import run_interpreted

INTERPRETED = "tests/unit/engine/test_engine_kernels_interpreted.py"


@pytest.mark.parametrize("broken", ["raises", "wrong"])
def test_a_kernel_that_fails_its_check_leaves_the_gradients_to_torch(monkeypatch, caplog, broken):
    def launch(entries, tensors):
        if broken == "raises":
            raise RuntimeError("no compiler here")

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    monkeypatch.setattr(lora_grad_kernel, "kernel_runs", lambda device: True)
    monkeypatch.setattr(lora_grad_kernel.CHECK, "checked", {})
    monkeypatch.setattr(lora_grad_kernel, "launch", launch)
    unpooled = fused_layer(ranks=(8, 8, 8))
    pooled = copy.deepcopy(unpooled)
    for adapter in pooled.adapters.values():
        pool_masters([adapter], torch.device("cpu"))
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    for layer in (pooled, unpooled):
        with step_layout(layout_of()):
            out = layer(x.clone().requires_grad_(True))
        (out.float() * upstream.float()).sum().backward()
    for name, adapter in pooled.adapters.items():
        assert torch.equal(adapter.lora_A.grad, unpooled.adapters[name].lora_A.grad)
        assert torch.equal(adapter.lora_B.grad, unpooled.adapters[name].lora_B.grad)
    assert lora_grad_kernel.CHECK.checked == {"cpu": False}
    warnings = [r.getMessage() for r in caplog.records if "grouped-gradient kernel" in r.getMessage()]
    assert len(warnings) == 1 and ("no compiler here" in warnings[0]) == (broken == "raises")


@pytest.mark.skipif(lora_grad_kernel.triton is None, reason="Triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="this process runs under Triton's interpreter")
def test_the_engine_s_kernels_under_triton_s_interpreter():
    """tests/unit/engine/test_engine_kernels_interpreted.py in a process started with TRITON_INTERPRET=1 (Triton's
    functions are made interpreted at its import): all of it passes, none of it skipped."""
    run_interpreted(INTERPRETED, timeout=600)
