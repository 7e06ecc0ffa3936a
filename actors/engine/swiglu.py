"""A gated MLP's `act(gate) * up` that keeps two tensors for backward instead of three.

The model's own `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (Llama, Mistral, Qwen2/3; SiLU) keeps for its
backward the gate's output (SiLU's input), SiLU's output and the up projection's output (the product's
operands): three intermediate-width tensors per token and layer, about a third of a decoder layer's activations
where the MLP is frozen. `SiluMul` keeps the gate's and the up projection's outputs and computes SiLU again in its
backward, with the same operations autograd runs (`silu`, the product, `silu_backward`), so values and gradients
are bit for bit the model's (tests/unit/engine/test_swiglu.py) while a step holds one intermediate-width tensor
less per token and layer. Elementwise, token by token: fused jobs stay isolated as with the model's operations.

`lean_swiglu(model)` rebinds each such MLP module's `forward` on this instance (the gate, up and down projections
stay its modules, so LoRA wraps them as before); where Liger's kernels run (actors/engine/kernels.py) their
SwiGLU, which also recomputes, takes the place of this one."""

from __future__ import annotations

import logging
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
_SILU = ("silu", "swish")


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SiluMul.apply(gate, up)
    return F.silu(gate) * up


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def lean_swiglu(model: nn.Module) -> int:
    """Rebind the forward of each SiLU-gated MLP of the architectures above; returns how many. A model of
    another architecture or activation is left as it is."""
    if getattr(getattr(model, "config", None), "hidden_act", None) not in _SILU:
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in MLP_CLASSES and all(hasattr(module, n) for n in ("gate_proj", "up_proj",
                                                                                      "down_proj")):
            module.forward = MethodType(_forward, module)
            count += 1
    return count
