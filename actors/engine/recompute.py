"""Activation recomputation of the fused step: each decoder layer keeps only its input for backward and
runs its forward again when backward reaches it (`torch.utils.checkpoint`, non-reentrant).

Two things the plain checkpoint does not carry over from the forward pass to the recomputation, both
restored here so that the recomputed forward is the same computation (bit for bit) and isolation holds:
- the step's token layout (`actors.engine.layout.step_layout`), a context that has ended by the time
  backward runs: it is captured at the forward and re-entered around the recomputation;
- the adapters' own dropout generators (`actors.engine.lora_adapter`; torch's checkpoint restores only the global
  RNGs): each generator's state at the layer's entry is saved and set again for the recomputation, and
  afterwards put back to where backward found it (so the next step draws what it would have drawn)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from actors.engine.layout import current_layout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.engine.vera import VeraAdapter
from actors.spec.base_settings import RECOMPUTE_MODES, Recompute

# Llama, Qwen2, Mistral, ...; GPT-J, CodeGen and GPT-BigCode (GPT-2's name); OPT (its decoder's)
LAYER_LISTS = ("layers", "h", "decoder.layers")


def decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    """The decoder's stack of transformer layers (`layers` in Llama, Qwen2, Mistral, ...; `h` in GPT-J, CodeGen,
    GPT-BigCode; `decoder.layers` in OPT)."""
    for name in LAYER_LISTS:
        layers = decoder
        for part in name.split("."):
            layers = getattr(layers, part, None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return layers
    lists = " or ".join(LAYER_LISTS)
    raise ValueError(f"recompute: layers needs a decoder with a list of transformer layers ({lists}); "
                     f"{type(decoder).__name__} has none (use recompute: none for this model)")


def _dropout_generators(layer: nn.Module) -> list[torch.Generator]:
    seen: dict[int, torch.Generator] = {}
    for module in layer.modules():
        if isinstance(module, (LoraAdapter, VeraAdapter)) and module.dropout_generator is not None:
            seen.setdefault(id(module.dropout_generator), module.dropout_generator)
    return list(seen.values())


_RECOMPUTING: set[int] = set()   # the layers (by id) whose forward runs now as a recomputation


class _RecomputedForward:
    """A layer's forward under a checkpoint; the first call is the forward pass, later ones recompute."""

    def __init__(self, layer: nn.Module, original: Any):
        self.layer = layer
        self.original = original
        self.layout = None
        self.states: list[tuple[torch.Generator, torch.Tensor]] | None = None

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if self.states is None:   # the forward pass: remember where the dropout generators start
            self.states = [(g, g.get_state()) for g in _dropout_generators(self.layer)]
            return self.original(*args, **kwargs)
        now = [(g, g.get_state()) for g, _ in self.states]
        for generator, state in self.states:
            generator.set_state(state)
        _RECOMPUTING.add(id(self.layer))
        try:
            layout = step_layout(self.layout) if self.layout is not None else contextlib.nullcontext()
            with layout:
                return self.original(*args, **kwargs)
        finally:
            _RECOMPUTING.discard(id(self.layer))
            for generator, state in now:
                generator.set_state(state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.original(*args, **kwargs)
        self.layout = current_layout()
        self.states = None
        return checkpoint(self._run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def is_recomputing(layer: nn.Module) -> bool:
    """Whether `layer`'s forward runs now as the backward's recomputation of it (`recompute: layers`; the backward runs
    after `recomputed_layers` closed, so the layer's forward is its own again then)."""
    return id(layer) in _RECOMPUTING


@contextlib.contextmanager
def recomputed_layers(decoder: nn.Module, mode: Recompute) -> Iterator[None]:
    """While open (around one step's forward pass), every decoder layer runs under a checkpoint."""
    if mode == "none":
        yield
        return
    if mode != "layers":
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, not '{mode}'")
    layers = decoder_layers(decoder)
    patched = []
    try:
        for layer in layers:
            own = vars(layer).get("forward")   # a forward rebound on the instance (kernels.py's), put back below
            layer.forward = _RecomputedForward(layer, layer.forward)   # an instance attribute, removed below
            patched.append((layer, own))
        yield
    finally:
        for layer, own in patched:
            if own is None:
                del layer.forward
            else:
                layer.forward = own
