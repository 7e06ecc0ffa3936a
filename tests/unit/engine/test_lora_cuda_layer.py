"""One fused layer on the CUDA LoRA path (actors/engine/lora_cuda.py), run on the CPU in bfloat16, both of its
kernels, against the exact arithmetic (float64 from the same bfloat16-valued inputs and float32 masters) within
bounds derived from bfloat16's rounding, and against the float32 path (actors/engine/fused_linear.py) that the CPU
keeps; a job's rows and gradients are its own (alone == fused, a NaN reaches no other job), tokens of no adapter get
the base's output only, dropout masks come from each job's generator, a biased base adds its bias's roundings. The
path in a model and its step (casts, the kernel's choice, memory): test_lora_cuda_step.py.

The bounds, elementwise (u = 2^-8, bfloat16's unit roundoff; |M| the entrywise absolute value; products of the
inputs are exact in float32 and every sum is accumulated in float32, whose error γ_n·|.| with γ_n = n·2^-24 is
added for the n terms of each sum):
- forward: the base product rounded once (u |x||W|^T), A and s·B rounded once each when cast, the down
  projection once, the accumulated update and the output once: 2u |x||W|^T + 4u s |x||A|^T|B|^T;
- the gradient of A: s·B cast (u), (g sB) rounded (u), its product with x rounded (u): 3u s (|g||B|)^T |x|;
  of B: A cast, x A^T rounded, g^T (x A^T) rounded: 3u s |g|^T (|x||A|^T);
- the gradient of x: g W rounded (u), then (g sB) A added and rounded: 2u |g||W| + 4u s |g||B||A|."""

from __future__ import annotations

import pytest
import torch

from actors.engine import lora_cuda, lora_layer_state
from actors.engine.layout import StepLayout
from tests.helpers.lora_bounds import (
    BOUNDS,
    F32,
    IN,
    OUT,
    RANKS,
    U,
    assert_layer_within,
    assert_within,
    bf16_values,
    exact,
    fused_layer,
    layout_of,
    run_layer,
)


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_forward_and_gradients_within_the_bfloat16_bounds_of_the_exact_arithmetic(monkeypatch, kernel):
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    assert out.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for a in layer.adapters.values() for p in (a.lora_A, a.lora_B))
    assert_layer_within(layer, x, upstream, out, grad_x)


def test_the_bounds_catch_a_wrong_update(monkeypatch):
    """The bound is tight enough to fail a real mistake: an update with the scaling applied twice."""
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    adapter = layer.adapters["job1"]
    original = lora_layer_state.compute_weights

    def doubled(layout, adapters, dtype):
        weights = original(layout, adapters, dtype)
        return [(a, b * adapter.scaling) if ad is adapter else (a, b)
                for ad, (a, b) in zip(adapters, weights, strict=True)]

    monkeypatch.setattr(lora_layer_state, "compute_weights", doubled)
    monkeypatch.setattr(lora_cuda, "KERNEL", "segments")
    out, _ = run_layer(layer, x, upstream, layout_of())
    expected, out_bound, *_ = exact(layer, x, upstream)
    assert not bool(((out[0].double() - expected).abs() <= out_bound).all())


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_equals_the_float32_path_within_the_bound(monkeypatch, kernel):
    """The float32 path (today's CPU path, float32 adapters on a float32 copy of the layer) on the same
    bfloat16-valued inputs: its own error is float32 rounding only, so the bfloat16 bound covers both."""
    layer16 = fused_layer()
    layer32 = fused_layer(torch.float32)
    with torch.no_grad():
        layer32.base.weight.copy_(layer16.base.weight.float())
        for a16, a32 in zip(layer16.adapters.values(), layer32.adapters.values(), strict=True):
            a32.lora_B.copy_(a16.lora_B)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    out16, grad16 = run_layer(layer16, x, upstream, layout_of())
    monkeypatch.setattr(lora_cuda, "COMPUTE", "float32")
    out32, grad32 = run_layer(layer32, x.float(), upstream.float(), layout_of())
    _, out_bound, _, grad_x_bound, _, grad_bounds = exact(layer16, x, upstream)
    assert_within(out16[0], out32[0].double(), out_bound * 1.01, "output against the float32 path")
    assert_within(grad16[0], grad32[0].double(), grad_x_bound * 1.01, "input gradient against the float32 path")
    for a16, a32, (bound_a, bound_b) in zip(layer16.adapters.values(), layer32.adapters.values(), grad_bounds,
                                            strict=True):
        assert_within(a16.lora_A.grad, a32.lora_A.grad.double(), bound_a * 1.01, "A's gradient, float32 path")
        assert_within(a16.lora_B.grad, a32.lora_B.grad.double(), bound_b * 1.01, "B's gradient, float32 path")


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_job_alone_equals_the_same_job_fused(monkeypatch, kernel):
    """Isolation: a job's output rows and gradients are its own segment's arithmetic, the same bit for bit
    whether other jobs share the layer (or the row order of the stream) or not."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    fused = {name: (a.lora_A.grad.clone(), a.lora_B.grad.clone()) for name, a in layer.adapters.items()}
    for index, (start, end) in enumerate(BOUNDS):
        name = f"job{index}"
        alone_out, alone_grad_x = run_layer(layer, x[:, start:end], upstream[:, start:end],
                                       layout_of(((0, end - start),), [name]))
        assert torch.equal(alone_out[0], out[0, start:end])
        assert torch.equal(alone_grad_x[0], grad_x[0, start:end])
        adapter = layer.adapters[name]
        assert torch.equal(adapter.lora_A.grad, fused[name][0]) and torch.equal(adapter.lora_B.grad, fused[name][1])


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_nan_in_one_job_reaches_no_other_job(monkeypatch, kernel):
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    run_layer(layer, x, upstream, layout_of())
    clean = {name: (a.lora_A.grad.clone(), a.lora_B.grad.clone()) for name, a in layer.adapters.items()}
    poisoned_x, poisoned_g = x.clone(), upstream.clone()
    poisoned_x[0, 13, 5] = float("nan")
    poisoned_g[0, 20, 3] = float("inf")
    out, grad_x = run_layer(layer, poisoned_x, poisoned_g, layout_of())
    assert not bool(out[0, 11:40].isfinite().all())
    for name in ("job0", "job2"):
        adapter = layer.adapters[name]
        assert torch.equal(adapter.lora_A.grad, clean[name][0]) and torch.equal(adapter.lora_B.grad, clean[name][1])
    assert bool(out[0, :11].isfinite().all()) and bool(out[0, 40:].isfinite().all())
    assert bool(grad_x[0, :11].isfinite().all()) and bool(grad_x[0, 40:].isfinite().all())


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_tokens_of_no_adapter_get_the_base_output_only(monkeypatch, kernel):
    """A job without an adapter on this layer (and the rows after the last segment): the base's product alone,
    as the exact arithmetic rounds it once; its rows' input gradient has no LoRA term."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer(ranks=RANKS[:2])
    bounds = ((0, 11), (11, 30), (30, 45), (45, 57))
    layout = StepLayout((("job0", 0, 11), ("other", 11, 30), ("job1", 30, 45), ("other2", 45, 57)),
                        tuple(bounds), 57)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout)
    base_only = layer.base(x)
    assert torch.equal(out[0, 11:30], base_only[0, 11:30]) and torch.equal(out[0, 45:], base_only[0, 45:])
    assert torch.equal(grad_x[0, 11:30], (upstream[0, 11:30] @ layer.base.weight))


def test_dropout_masks_come_from_each_jobs_generator_and_backward_uses_them():
    layer = fused_layer(ranks=(4, 8))
    drop = layer.adapters["job0"]
    drop.dropout = 0.25
    drop.dropout_generator = torch.Generator().manual_seed(7)
    layer.adapters.train(True)
    x, upstream = bf16_values(1, 40, IN), bf16_values(1, 40, OUT)
    replay = torch.Generator().set_state(drop.dropout_generator.get_state())
    mask = torch.empty(11, IN, dtype=torch.bfloat16).bernoulli_(0.75, generator=replay)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    out, grad_x = run_layer(layer, x, upstream, layout_of(((0, 11), (11, 40))))
    # the reference: the same job with its input's dropped entries zeroed and the rest scaled by 1/keep, exactly
    dropped = (x[0, :11].double() * mask.double()) / 0.75
    a, b, s = drop.lora_A.double(), drop.lora_B.double(), drop.scaling
    expected = x[0, :11].double() @ layer.base.weight.double().t() + s * (dropped @ a.t()) @ b.t()
    magnitude = x[0, :11].double().abs() @ layer.base.weight.double().abs().t()
    lora_magnitude = s * (dropped.abs() @ a.abs().t()) @ b.abs().t()
    assert_within(out[0, :11], expected, (2 * U + IN * F32) * magnitude + (5 * U + 2 * IN * F32) * lora_magnitude,
            "output with dropout")
    g = upstream[0, :11].double()
    expected_grad_a = s * (g @ b).t() @ dropped
    bound_a = (3 * U + 64 * F32) * s * (g.abs() @ b.abs()).t() @ dropped.abs()
    assert_within(drop.lora_A.grad, expected_grad_a, bound_a, "A's gradient with dropout")
    expected_grad_x = g @ layer.base.weight.double() + s * ((g @ b) @ a) * mask.double() / 0.75
    bound_x = ((2 * U + OUT * F32) * (g.abs() @ layer.base.weight.double().abs())
               + (5 * U + 2 * OUT * F32) * s * ((g.abs() @ b.abs()) @ a.abs()) * mask.double() / 0.75)
    assert_within(grad_x[0, :11], expected_grad_x, bound_x, "input gradient with dropout")



@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_biased_base_within_the_bounds_plus_the_bias_rounding(monkeypatch, kernel):
    """A base with a bias (Qwen2's q, k, v): the grouped kernel adds it to the jobs' update before the base product
    is accumulated into it, so the output is the exact x W^T + b + updates within the bias-free bound plus the
    bias's own roundings (added to the update, then in the output: 2u |b|, doubled for the sums it joins)."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = fused_layer(bias=True)
    with torch.no_grad():
        layer.base.bias.copy_(bf16_values(OUT) * 4)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    expected, out_bound, grad_x_exact, grad_x_bound, *_ = exact(layer, x, upstream)
    bias = layer.base.bias.double()
    assert_within(out[0], expected + bias, out_bound + 4 * U * bias.abs(), "output with a bias")
    assert_within(grad_x[0], grad_x_exact, grad_x_bound, "input gradient with a bias")
    assert not bool(((out[0].double() - expected).abs() <= out_bound).all())   # the bias is really there
