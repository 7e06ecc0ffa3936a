"""q, k and v of three jobs reading one input, and their exact arithmetic's bounds, for the tests of adapted layers
computed together (actors/engine/lora_siblings.py): tests/unit/engine/test_lora_siblings.py on the CPU, tests/gpu/ on
CUDA."""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.adapter_surgery import _link_siblings, pool_masters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig
from tests.helpers.lora_bounds import IN, SCALINGS, assert_within, bf16_values, exact, layout_of

OUTS = {"q_proj": 40, "k_proj": 16, "v_proj": 16}
RANK = 8


def attention(dropout_in: str | None = None, device: str = "cpu", bias: bool = False) -> nn.Module:
    """q, k and v of three jobs (rank 8, the jobs' scalings), each job's adapters pooled across the three; `bias`:
    the base layers with biases (Qwen2's q, k and v)."""
    torch.manual_seed(0)
    parent = nn.Module()
    per_job: list[list[LoraAdapter]] = [[] for _ in SCALINGS]
    for name, out in OUTS.items():
        layer = FusedLoraLinear(nn.Linear(IN, out, bias=bias).to(device, torch.bfloat16).requires_grad_(False))
        for index, scaling in enumerate(SCALINGS):
            dropout = 0.3 if name == dropout_in and index == 1 else 0.0
            adapter = LoraAdapter(IN, out, LoraConfig(r=RANK, alpha=RANK * scaling, dropout=dropout),
                                  generator=torch.Generator().manual_seed(index), device=torch.device(device))
            with torch.no_grad():
                adapter.lora_B.normal_()
            layer.adapters[f"job{index}"] = adapter
            per_job[index].append(adapter)
        setattr(parent, name, layer)
    for adapters in per_job:
        pool_masters(adapters, torch.device(device))
    _link_siblings(parent)
    return parent


def run(parent: nn.Module, x: torch.Tensor, upstream: dict[str, torch.Tensor], inputs: dict | None = None):
    """Each layer's output on `x` (or `inputs[name]`), called in order as an attention module calls them, and the
    gradients of sum(out * upstream): (outputs, x's gradient, each layer's adapters' (A, B) gradients)."""
    for layer in parent.children():
        for adapter in layer.adapters.values():
            adapter.lora_A.grad = adapter.lora_B.grad = None
    x = x.detach().clone().requires_grad_(True)
    with step_layout(layout_of()):
        outs = {name: getattr(parent, name)((inputs or {}).get(name, x)) for name in OUTS}
    sum((outs[name].float() * upstream[name].float()).sum() for name in OUTS).backward()
    grads = {name: [(a.lora_A.grad.clone(), a.lora_B.grad.clone()) for a in getattr(parent, name).adapters.values()]
             for name in OUTS}
    return outs, x.grad, grads


def counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def inputs(device: str = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return bf16_values(1, 57, IN).to(device), {name: bf16_values(1, 57, out).to(device) for name, out in OUTS.items()}



def assert_within_the_bounds(parent: nn.Module, x: torch.Tensor, upstream: dict[str, torch.Tensor]) -> None:
    """`run`'s outputs and gradients against the exact arithmetic within bfloat16's bounds (the input gradient within
    twice the sum of the layers' bounds: tests/unit/engine/test_lora_siblings.py's docstring)."""
    outs, grad_x, grads = run(parent, x, upstream)
    grad_x_exact = grad_x_bound = 0
    for name in OUTS:
        expected, out_bound, layer_grad_x, layer_bound, exact_grads, bounds = exact(getattr(parent, name), x,
                                                                                   upstream[name])
        assert_within(outs[name][0], expected, out_bound, f"{name}'s output")
        for (grad_a, grad_b), (want_a, want_b), (bound_a, bound_b) in zip(grads[name], exact_grads, bounds,
                                                                           strict=True):
            assert_within(grad_a, want_a, bound_a, f"{name}'s A gradient")
            assert_within(grad_b, want_b, bound_b, f"{name}'s B gradient")
        grad_x_exact, grad_x_bound = grad_x_exact + layer_grad_x, grad_x_bound + layer_bound
    assert_within(grad_x[0], grad_x_exact, 2 * grad_x_bound, "input gradient")
