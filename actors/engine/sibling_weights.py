"""The frozen weights of layers that read one input (q, k and v; gate and up) as row blocks of one tensor.

Computed together (actors/engine/lora_siblings.py), such layers' base products are one GEMM over the stacked weights
(x · [W_q; W_k; W_v]ᵀ) where their weights are rows of one tensor: one launch instead of one per layer forward and
backward, and a larger, more efficient product. `fused_weights` makes them so once, in place of the model's own
parameters: the stacked tensor is made, each layer's `weight` (and `bias`) becomes a parameter viewing its rows, and
the separate tensors are freed, so the model holds the same bytes as before (the memory model counts each storage
once: `memory.model_bytes`). The values are the same numbers, so everything that reads the layers (the model's own
code, a step without adapters, an export of the base) reads what it read before.

Weights that already lie so (stacked before, for a set made anew when its layers are wrapped again; or loaded so)
are taken as they lie, without a copy. Only frozen, full-precision weights of one dtype and device, with biases on
all the layers or on none, are stacked (quantized layers hold their weights otherwise). Where a layer's weight was
replaced since (`Stacked.current`), the stack is made again from the weights the layers hold then. Where the device
has no room for the stack (it is made beside the weights it replaces), the layers are computed one by one (logged)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stacked:
    """The layers' weights stacked (rows: the layers in order) and their biases (or None), with the parameters that
    view them (to see that the layers still hold them)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    views: tuple[nn.Parameter, ...]

    def current(self, bases: list[nn.Module]) -> bool:
        return len(bases) * (2 if self.bias is not None else 1) == len(self.views) and all(
            held is view for held, view in zip(_held(bases, self.bias is not None), self.views, strict=True))


def fused_weights(bases: list[nn.Module], kept: Stacked | None) -> Stacked | None:
    """The base layers' weights as rows of one tensor (`kept` where the layers still view it); None where they cannot
    be stacked (see the module's docstring), `REFUSED` where the device had no room for the stack (logged; not tried
    again for these layers: each try would flush the allocator's cache)."""
    if kept is REFUSED or (kept is not None and kept.current(bases)):
        return kept
    weights = [base._parameters.get("weight") for base in bases]
    biases = [base._parameters.get("bias") for base in bases]
    first = weights[0]
    if first is None or first.dim() != 2 or any(
            weight is None or weight.requires_grad or weight.dim() != 2 or weight.dtype != first.dtype
            or weight.device != first.device or weight.shape[1] != first.shape[1] or not weight.is_floating_point()
            for weight in weights):
        return None
    with_bias = [bias is not None for bias in biases]
    if any(with_bias) and not all(with_bias) or any(bias is not None and bias.requires_grad for bias in biases):
        return None
    weight = _lying_as_rows(weights)
    bias = _lying_as_rows(biases) if all(with_bias) else None
    if weight is not None and (bias is not None or not all(with_bias)):   # stacked before (a set made anew)
        return Stacked(weight, bias, tuple(_held(bases, bias is not None)))
    try:
        weight = _rows_of_one(weights)
        bias = _rows_of_one(biases) if all(with_bias) else None
    except torch.OutOfMemoryError:   # the stack is made beside the layers' weights, which it then replaces
        log.warning("no room on %s to stack the frozen weights of %d layers reading one input (%.0f MB, once); "
                    "they are computed one by one (more launches a step) for as long as they stay adapted: leave "
                    "more of the device free (a smaller memory budget or step) to have them stacked",
                    first.device, len(weights), sum(w.numel() * w.element_size() for w in weights) / 1e6)
        return REFUSED
    views = []
    start = 0
    for base, old in zip(bases, weights, strict=True):
        rows = slice(start, start + old.shape[0])
        base._parameters["weight"] = view = nn.Parameter(weight[rows], requires_grad=False)
        views.append(view)
        if bias is not None:
            base._parameters["bias"] = bias_view = nn.Parameter(bias[rows], requires_grad=False)
            views.append(bias_view)
        start = rows.stop
    return Stacked(weight, bias, tuple(views))


def _lying_as_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one, where they already lie one after another in one storage (stacked before), else None."""
    first = tensors[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage
                or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    rows = sum(tensor.shape[0] for tensor in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _rows_of_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(tensors)


REFUSED = Stacked(torch.empty(0), None, ())   # no room to stack: the layers are computed one by one


def _held(bases: list[nn.Module], with_bias: bool) -> list:
    held = []
    for base in bases:
        held.append(base._parameters.get("weight"))
        if with_bias:
            held.append(base._parameters.get("bias"))
    return held
