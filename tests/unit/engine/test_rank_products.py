"""How the rank-wide LoRA products choose their kernel (actors/engine/rank_products.py; the measuring itself:
test_kernel_tuning.py): on a CPU `auto` is grouped_mm, a forced split_k needs a kernel that runs, a product too wide
or a device without Triton has grouped_mm alone, and a shape's choice is what its later calls run. The kernel itself
runs under Triton's interpreter in a process of its own (test_rank_products_interpreted.py, started here) and on a GPU
in tests/gpu."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from actors.engine import rank_products
from tests.helpers.triton_interpreter import run_interpreted


def _products_on_this_cpu():
    """(module, its forced Triton way, the call, its operands, the exact result): the rank-wide down projection and
    the weight gradients' sums, each over two jobs' rows."""
    from actors.engine import weight_grad_products

    x, a_stack = torch.randn(40, 32).to(torch.bfloat16), torch.randn(2, 8, 32).to(torch.bfloat16)
    left, right = torch.randn(40, 16).to(torch.bfloat16), torch.randn(40, 32).to(torch.bfloat16)
    down = torch.cat([x[:16].float() @ a_stack[0].float().t(), x[16:].float() @ a_stack[1].float().t()])
    sums = torch.stack([left[:16].float().t() @ right[:16].float(), left[16:].float().t() @ right[16:].float()])
    return [(rank_products, "split_k", rank_products.down, (x, a_stack), down),
            (weight_grad_products, "jagged", weight_grad_products.sums, (left, right), sums)]


@pytest.mark.parametrize("which", [0, 1], ids=["x A^T", "weight gradients"])
def test_auto_on_a_cpu_is_grouped_mm_and_a_forced_kernel_needs_one_that_runs(monkeypatch, which):
    module, forced, call, operands, expected = _products_on_this_cpu()[which]
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    offsets = torch.tensor([16, 40], dtype=torch.int32)
    for way in ("auto", forced):   # forced: no Triton runs on this CPU outside the interpreter
        monkeypatch.setattr(module, "WAY", way)
        got = call(*operands, offsets)
        assert torch.allclose(got.float(), expected, rtol=2 ** -7, atol=1e-2)
    assert len(calls) == 2


def test_too_wide_a_product_or_no_triton_has_grouped_mm_alone(monkeypatch):
    assert rank_products._candidates(torch.device("cpu"), rank_products.MAX_WIDTH + 8) == ["grouped_mm"]
    monkeypatch.setattr(rank_products, "triton_runs", lambda device: False)   # a CUDA torch without Triton
    monkeypatch.setattr(rank_products.CHECK, "agrees", lambda device: pytest.fail("checked a kernel that cannot run"))
    assert rank_products._candidates(torch.device("cuda"), 48) == ["grouped_mm"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_kernel_under_triton_s_interpreter():
    run_interpreted("tests/unit/engine/test_rank_products_interpreted.py", timeout=600)


def test_a_shape_s_choice_is_what_its_later_calls_run(monkeypatch):
    """Once chosen, a call goes straight to the kernel (grouped_mm, or split_k at the chosen part size)."""
    from actors.engine import kernel_tuning

    monkeypatch.setattr(kernel_tuning, "TUNINGS", {})
    ran = []
    monkeypatch.setattr(rank_products, "split_k", lambda left, w, offs, transposed, size: ran.append(("split_k", size))
                        or torch.zeros(left.shape[0], w.shape[1]))
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: ran.append(("grouped_mm",)) or real(*a, **k))
    x, a_stack = torch.randn(40, 32).to(torch.bfloat16), torch.randn(2, 8, 32).to(torch.bfloat16)
    offsets = torch.tensor([16, 40], dtype=torch.int32)
    key = ("rank", True, 32, 8, 2, torch.bfloat16, None)
    for chosen, expected in (("split_k:2048", ("split_k", 2048)), ("grouped_mm", ("grouped_mm",))):
        tuning = kernel_tuning.Tuning("x A^T", ["grouped_mm", "split_k:1024", "split_k:2048"])
        tuning.chosen = chosen
        kernel_tuning.TUNINGS[key] = tuning
        rank_products._product(x, a_stack, offsets, True)
        assert ran[-1] == expected


def test_the_weight_gradients_sums_choice_is_what_later_calls_run(monkeypatch):
    from actors.engine import kernel_tuning, weight_grad_products

    monkeypatch.setattr(kernel_tuning, "TUNINGS", {})
    ran = []
    monkeypatch.setattr(weight_grad_products, "jagged", lambda left, right, offs: ran.append("jagged")
                        or torch.zeros(offs.shape[0], left.shape[1], right.shape[1]))
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: ran.append("grouped_mm") or real(*a, **k))
    left, right = torch.randn(40, 16).to(torch.bfloat16), torch.randn(40, 32).to(torch.bfloat16)
    offsets = torch.tensor([16, 40], dtype=torch.int32)
    key = ("weight-grad", 16, 32, 2, torch.bfloat16, None)
    for chosen in ("jagged", "grouped_mm"):
        tuning = kernel_tuning.Tuning("sums", ["grouped_mm", "jagged"])
        tuning.chosen = chosen
        kernel_tuning.TUNINGS[key] = tuning
        weight_grad_products._tuned(left, right, offsets)
        assert ran[-1] == chosen
