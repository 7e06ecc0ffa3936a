"""The rank-wide LoRA products' split-K kernel (actors/engine/rank_products.py) and the weight gradients' jagged kernel
(weight_grad_products.py) on CUDA (skipped without a GPU): their once-a-device checks pass; each at the 8B shape's
sizes agrees with float64 per-job products within a bfloat16 rounding plus float32's sum; a job's rows (or sums) come
out bit for bit the same alone as fused with others; split-K's parts add in one order every launch; `auto` measures
without making the host wait (CUDA's sync debug mode raises on a synchronising call) and settles on a kernel; and a
fused layer on both kernels stays within the bfloat16 bounds."""

from __future__ import annotations

import pytest
import torch

from actors.engine import rank_products, weight_grad_products

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")
# 4 jobs of uneven rows with a gap group between two (a segment end inside a 64-row block), 3,328 tokens in all
BOUNDS = [(0, 700), (700, 1001), (1001, 1010), (1010, 2300), (2300, 3328)]


def _operands(features: int, width: int, transposed: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(BOUNDS[-1][1], features, generator=generator).to(torch.bfloat16)
    shape = (len(BOUNDS), width, features) if transposed else (len(BOUNDS), features, width)
    weights = (torch.randn(*shape, generator=generator) * features ** -0.5).to(torch.bfloat16)
    offsets = torch.tensor([end for _, end in BOUNDS], dtype=torch.int32)
    return left.to(CUDA), weights.to(CUDA), offsets.to(CUDA)


def test_the_kernel_passes_its_check_on_this_gpu():
    assert rank_products.CHECK.works(CUDA)


@pytest.mark.parametrize("features,width,transposed,split", [
    (4096, 48, True, 1024), (4096, 48, False, 2048), (14336, 16, True, 2048), (28672, 32, False, 1024)],
    ids=["qkv x A^T", "o g B", "down x A^T", "gate_up g B"])
def test_each_job_s_rows_within_the_bfloat16_bound_of_float64(transposed, features, width, split):
    """Against float64 products on the GPU (the references' time stays small beside the lease's limit)."""
    left, weights, offsets = _operands(features, width, transposed)
    got = rank_products.split_k(left, weights, offsets, transposed, split).double()
    within = []
    for group, (start, end) in enumerate(BOUNDS):
        factor = (weights[group].t() if transposed else weights[group]).double()
        exact = left[start:end].double() @ factor
        magnitude = left[start:end].double().abs() @ factor.abs()
        within.append(((got[start:end] - exact).abs() <= (2.0 ** -8 + features * 2.0 ** -24) * magnitude).all())
    assert torch.stack(within).tolist() == [True] * len(BOUNDS)


@pytest.mark.parametrize("transposed", [True, False], ids=["x A^T", "g B"])
def test_a_job_s_rows_are_bit_for_bit_those_it_gets_alone(transposed):
    left, weights, offsets = _operands(4096, 48, transposed, seed=1)
    fused = rank_products.split_k(left, weights, offsets, transposed)
    for group, (start, end) in enumerate(BOUNDS):
        alone = rank_products.split_k(left[start:end].contiguous(), weights[group:group + 1].contiguous(),
                                      torch.tensor([end - start], dtype=torch.int32, device=CUDA), transposed)
        assert torch.equal(fused[start:end], alone), group


def test_the_parts_sum_in_one_order_every_launch_and_leave_their_counters_at_zero():
    """Each row block's last part to arrive adds the parts (which part is last varies from launch to launch): the
    result is the same bits every time, and the counters are back at zero for the next launch."""
    left, weights, offsets = _operands(14336, 16, True, seed=2)
    first = rank_products.split_k(left, weights, offsets, True, 1024)
    for _ in range(20):
        assert torch.equal(rank_products.split_k(left, weights, offsets, True, 1024), first)
    torch.cuda.synchronize()
    assert all(int(counters.abs().sum()) == 0 for counters in rank_products._COUNTERS.values())


def test_auto_settles_on_a_kernel_without_the_host_waiting(monkeypatch):
    from actors.engine import kernel_tuning

    monkeypatch.setattr(kernel_tuning, "TUNINGS", {})
    monkeypatch.setattr(rank_products, "WAY", "auto")
    left, weights, offsets = _operands(4096, 48, True)
    rank_products.down(left, weights, offsets)   # the candidates' first, untimed calls: compiles outside the check
    rank_products.down(left, weights, offsets)
    rank_products.down(left, weights, offsets)
    torch.cuda.synchronize()
    calls = 3 * (1 + kernel_tuning.SAMPLES)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(calls):
            rank_products.down(left, weights, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    rank_products.down(left, weights, offsets)
    (decision,) = rank_products.decisions().values()
    assert decision["chosen"] in ("grouped_mm", *(f"split_k:{size}" for size in rank_products.SPLIT_FEATURES))
    assert all(time is not None and time > 0 for time in decision["median_ms"].values()), decision


def test_a_fused_layer_on_the_triton_kernels_is_within_the_bfloat16_bounds(monkeypatch):
    from actors.engine import lora_cuda
    from tests.helpers.lora_bounds import IN, OUT, assert_layer_within, bf16_values, fused_layer, layout_of, run_layer

    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    monkeypatch.setattr(rank_products, "WAY", "split_k")
    monkeypatch.setattr(weight_grad_products, "WAY", "jagged")
    calls = []
    real, real_jagged = rank_products.split_k, weight_grad_products.jagged
    monkeypatch.setattr(rank_products, "split_k", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    monkeypatch.setattr(weight_grad_products, "jagged", lambda *a: calls.append("jagged") or real_jagged(*a))
    layer = fused_layer(device="cuda")
    x, upstream = bf16_values(1, 57, IN).cuda(), bf16_values(1, 57, OUT).cuda()
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    assert set(calls) == {False, True, "jagged"}
    assert_layer_within(layer, x, upstream, out, grad_x)


@pytest.mark.parametrize("m,n", [(48, 4096), (28672, 32)], ids=["qkv dA", "gate_up dB"])
def test_the_jagged_sums_within_the_bfloat16_bound_of_float64_and_as_alone(m, n):
    assert weight_grad_products.CHECK.works(CUDA)
    generator = torch.Generator().manual_seed(5)
    left = torch.randn(BOUNDS[-1][1], m, generator=generator).to(CUDA, torch.bfloat16)
    right = torch.randn(BOUNDS[-1][1], n, generator=generator).to(CUDA, torch.bfloat16)
    offsets = torch.tensor([end for _, end in BOUNDS], dtype=torch.int32, device=CUDA)
    got = weight_grad_products.jagged(left, right, offsets)
    within, alike = [], []
    for group, (start, end) in enumerate(BOUNDS):
        first, second = left[start:end].double().t(), right[start:end].double()
        bound = (2.0 ** -8 + (end - start) * 2.0 ** -24) * (first.abs() @ second.abs())
        within.append(((got[group].double() - first @ second).abs() <= bound).all())
        alone = weight_grad_products.jagged(left[start:end].contiguous(), right[start:end].contiguous(),
                                            torch.tensor([end - start], dtype=torch.int32, device=CUDA))
        alike.append(torch.equal(got[group], alone[0]))
    assert torch.stack(within).tolist() == [True] * len(BOUNDS) and alike == [True] * len(BOUNDS)
