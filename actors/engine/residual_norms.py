"""`kernels: liger`'s decoder layers (actors/engine/kernels.py, op `add_rms_norm`): each residual addition and the
RMSNorm that reads its sum computed by Liger's fused add-RMSNorm kernel (`LigerFusedAddRMSNormFunction`).

A pre-norm decoder layer of Llama, Mistral, Qwen2 and Qwen3 (transformers' `LlamaDecoderLayer.forward`) adds its
attention's output to the residual stream and normalizes the sum for its MLP, then adds its MLP's output, whose sum
the next layer normalizes first. Each such addition and norm is one kernel here: in the forward it writes the sum
and its norm in one pass; in the backward it writes the norm's input gradient with the residual's gradient added,
where autograd summed the two in a kernel of its own. Within a layer (`decoder_layer_forward`): the attention's
addition and the post-attention norm. Across layers (`link_layers`): the MLP's addition at a layer's end and the
next layer's input norm; the layer computes that norm and leaves it in the step's layout for the next layer, which
takes it where its input is the sum it was made from (same tensor, same version); else (its recomputation under
`recompute: layers`, which must give the values its forward saved) it runs the same kernel on its input with zeros
added, the same values. Outside a training step (no layout: generation, evaluation) a layer adds and normalizes as
transformers' does, the attention's addition and norm fused. The last layer's sum goes to the model's final norm as
it is.

The kernel rounds the sum to the input's dtype, as `residual + hidden_states` does, then normalizes it in Liger's
Llama casting (the mean square in float32, the product with the weight in the input's dtype), as Liger's RMSNorm
does; it works token by token (isolation: kernels.py). Its backward writes into the norm output's gradient (Liger's
`in_place=True`: that gradient is the next projections' own tensor) and hands that one tensor to both of its inputs,
whose consumers read it (kernels.py's docstring)."""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import torch
from torch import nn

from actors.engine.layout import current_layout
from actors.engine.recompute import is_recomputing

LIGER: ModuleType | None = None   # liger_kernel.transformers.functional (set by kernels.py when it swaps these in)
NEXT_NORM = "_aspen_next_norm"    # a layer's attribute: the next layer's input norm, which it computes
LINKED = "_aspen_norm_linked"     # a layer's attribute: the layer before computes its input norm
_NORMED = "residual-norms"         # the step layout's key of a norm computed for the next layer


def pre_norm_layer(layer: nn.Module, norm_class: str) -> bool:
    """Whether a decoder layer holds what `decoder_layer_forward` calls: its two norms of class `norm_class` (with
    `variance_epsilon`), its attention and its MLP."""
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    return (all(type(norm).__name__ == norm_class and hasattr(norm, "variance_epsilon") for norm in norms)
            and isinstance(getattr(layer, "self_attn", None), nn.Module)
            and isinstance(getattr(layer, "mlp", None), nn.Module))


def link_layers(layers: list[nn.Module]) -> None:
    """Each of `layers` (consecutive decoder layers, in order, each swapped to `decoder_layer_forward`) computes the
    next one's input norm with its last addition."""
    for layer, after in zip(layers, layers[1:], strict=False):
        layer.__dict__[NEXT_NORM] = after.input_layernorm
        after.__dict__[LINKED] = True


def _add_and_norm(hidden_states: torch.Tensor, residual: torch.Tensor, norm: nn.Module
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + hidden_states), residual + hidden_states) in one kernel."""
    return LIGER.liger_fused_add_rms_norm(hidden_states, residual, norm.weight, norm.variance_epsilon, 0.0, "llama",
                                          True)


def decoder_layer_forward(self: nn.Module, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """transformers' decoder layer of these architectures (module docstring): the attention on the input's norm added
    to the input, the MLP on that sum's norm added to it; the additions with the norms after them one kernel each.
    The layer's keyword arguments go to its attention as transformers' layer passes them."""
    layout = current_layout()
    normed = None
    if layout is not None and self.__dict__.get(LINKED):
        normed = _taken(layout, self.input_layernorm, hidden_states)
        if normed is None:
            normed = _alone(self, hidden_states)
    if normed is None:
        normed = self.input_layernorm(hidden_states)
    attended, _ = self.self_attn(hidden_states=normed, **kwargs)
    normed, residual = _add_and_norm(attended, hidden_states, self.post_attention_layernorm)
    out = self.mlp(normed)
    after = self.__dict__.get(NEXT_NORM)
    if after is None or layout is None:
        return residual + out
    normed, total = _add_and_norm(out, residual, after)
    if not is_recomputing(self):   # a recomputation's sum is not the next layer's input (the forward's was)
        layout.tensors[(_NORMED, id(after))] = (weakref.ref(total), total._version, normed)
    return total


def _alone(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A linked layer's input norm without the one the layer before made: the same kernel on its input with zeros
    added (the same values). In its recomputation (`recompute: layers`), whose forward took the norm from the layer
    before, outside autograd and as a leaf needing a gradient as that norm did: the recomputation then saves the
    tensors, and the values, that the forward saved."""
    norm = layer.input_layernorm
    if not is_recomputing(layer):
        return _add_and_norm(torch.zeros_like(hidden_states), hidden_states, norm)[0]
    with torch.no_grad():
        normed = _add_and_norm(torch.zeros_like(hidden_states), hidden_states, norm)[0]
    return normed.requires_grad_(hidden_states.requires_grad)


def _taken(layout: object, norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The norm of `hidden_states` the layer before computed for `norm`, once, where `hidden_states` is the very sum
    it was made from (unchanged since); else None."""
    kept = layout.tensors.pop((_NORMED, id(norm)), None)
    if kept is None or kept[0]() is not hidden_states or kept[1] != hidden_states._version:
        return None
    return kept[2]
