"""A fused LoRA layer of three jobs and the exact arithmetic it approximates in bfloat16, with the elementwise
bounds derived from bfloat16's rounding (tests/unit/engine/test_lora_cuda_layer.py's docstring derives them): shared
by the CPU tests of the CUDA LoRA path and the same checks on a GPU (tests/gpu/)."""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.adapter_surgery import pool_masters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig

U = 2.0 ** -8
F32 = 2.0 ** -24
IN, OUT = 48, 40
RANKS = (4, 8, 2)
BOUNDS = ((0, 11), (11, 40), (40, 57))   # three jobs' contiguous segments
SCALINGS = (2.0, 0.5, 4.0)


def fused_layer(dtype: torch.dtype = torch.bfloat16, ranks=RANKS, bias: bool = False,
                device: str = "cpu") -> FusedLoraLinear:
    torch.manual_seed(0)
    base = nn.Linear(IN, OUT, bias=bias).to(device, dtype).requires_grad_(False)
    layer = FusedLoraLinear(base)
    for index, (rank, scaling) in enumerate(zip(ranks, SCALINGS, strict=False)):
        adapter = LoraAdapter(IN, OUT, LoraConfig(r=rank, alpha=rank * scaling),
                              generator=torch.Generator().manual_seed(index), device=torch.device(device))
        with torch.no_grad():
            adapter.lora_B.normal_()
        layer.adapters[f"job{index}"] = adapter
    return layer


def pooled_layer(ranks=(8, 8, 8), device: str = "cpu", like: FusedLoraLinear | None = None) -> FusedLoraLinear:
    """`fused_layer` in bfloat16 with each job's adapter pooled (as add_adapter pools a job's); `like`: with that
    layer's masters (a layer of its own, which nothing kept between steps is known for)."""
    layer = fused_layer(ranks=ranks, device=device)
    for adapter in layer.adapters.values():
        pool_masters([adapter], torch.device(device))
    if like is not None:
        with torch.no_grad():
            for name, adapter in layer.adapters.items():
                adapter.lora_A.copy_(like.adapters[name].lora_A)
                adapter.lora_B.copy_(like.adapters[name].lora_B)
    return layer


def layout_of(bounds=BOUNDS, names=None) -> StepLayout:
    names = names or [f"job{index}" for index in range(len(bounds))]
    return StepLayout(tuple((name, s, e) for name, (s, e) in zip(names, bounds, strict=True)),
                      tuple(bounds), bounds[-1][1])


def bf16_values(*shape) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def run_layer(layer: FusedLoraLinear, x: torch.Tensor, upstream: torch.Tensor, layout: StepLayout):
    for adapter in layer.adapters.values():
        adapter.lora_A.grad = adapter.lora_B.grad = None
    x = x.detach().clone().requires_grad_(True)
    with step_layout(layout):
        out = layer(x)
    (out.float() * upstream.float()).sum().backward()
    return out, x.grad


def exact(layer: FusedLoraLinear, x: torch.Tensor, upstream: torch.Tensor, bounds=BOUNDS):
    """Float64 forward and gradients, and their bounds (tests/unit/engine/test_lora_cuda_layer.py derives them)."""
    weight = layer.base.weight.double().cpu()
    x64, g = x.double()[0].cpu(), upstream.double()[0].cpu()
    out = x64 @ weight.t()
    out_bound = 2 * U * (x64.abs() @ weight.abs().t()) + IN * F32 * (x64.abs() @ weight.abs().t())
    grad_x = g @ weight
    grad_x_bound = (2 * U + OUT * F32) * (g.abs() @ weight.abs())
    grads, grad_bounds = [], []
    for adapter, (start, end) in zip(layer.adapters.values(), bounds, strict=True):
        a, b, s = adapter.lora_A.double().cpu(), adapter.lora_B.double().cpu(), adapter.scaling
        rows, rows_g = x64[start:end], g[start:end]
        out[start:end] += s * (rows @ a.t()) @ b.t()
        magnitude = s * (rows.abs() @ a.abs().t()) @ b.abs().t()
        out_bound[start:end] += (4 * U + 2 * (IN + adapter.r) * F32) * magnitude
        grad_x[start:end] += s * (rows_g @ b) @ a
        grad_x_bound[start:end] += (4 * U + 2 * (OUT + adapter.r) * F32) * s * (rows_g.abs() @ b.abs()) @ a.abs()
        grads.append((s * (rows_g @ b).t() @ rows, s * rows_g.t() @ (rows @ a.t())))
        n = end - start
        grad_bounds.append(((3 * U + (OUT + n) * F32) * s * (rows_g.abs() @ b.abs()).t() @ rows.abs(),
                            (3 * U + (IN + n) * F32) * s * rows_g.abs().t() @ (rows.abs() @ a.abs().t())))
    return out, out_bound, grad_x, grad_x_bound, grads, grad_bounds


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    excess = (got.double().cpu() - expected).abs() - bound
    assert bool((excess <= 0).all()), f"{what}: {float(excess.max()):.3g} beyond its bound"


def assert_layer_within(layer: FusedLoraLinear, x: torch.Tensor, upstream: torch.Tensor, out: torch.Tensor,
                        grad_x: torch.Tensor, bounds=BOUNDS) -> None:
    """`run_layer`'s output, input gradient and each adapter's gradients within the bounds `exact` derives."""
    expected, out_bound, grad_x_exact, grad_x_bound, grads, grad_bounds = exact(layer, x, upstream, bounds)
    assert_within(out[0], expected, out_bound, "output")
    assert_within(grad_x[0], grad_x_exact, grad_x_bound, "input gradient")
    for adapter, (grad_a, grad_b), (bound_a, bound_b) in zip(layer.adapters.values(), grads, grad_bounds, strict=True):
        assert_within(adapter.lora_A.grad, grad_a, bound_a, "A's gradient")
        assert_within(adapter.lora_B.grad, grad_b, bound_b, "B's gradient")
