"""Layers that carry a state along the row, over a packed step: Qwen3.5's and Qwen3-Next's Gated DeltaNet (linear
attention) and LFM2's short convolution run their state-carrying functions sequence by sequence.

A Gated DeltaNet layer runs a depthwise causal convolution over the last few tokens, then a recurrent state updated
token by token (the gated delta rule); an LFM2 convolution layer runs the convolution alone. Over a packed row, the
first tokens of a sequence would see the previous sequence's last tokens through the convolution, and the delta
rule's state would start where the previous sequence's ended, so a job's loss would depend on its neighbours.
transformers' layers call functions of their modeling module for these (`causal_conv1d_forward`,
`torch_chunk_gated_delta_rule`; the projections, gates and norms around them are per token); while a fused step's
layout is current (actors/engine/layout.py), each is run here on every sequence of the row by itself, as the model
computes a lone sequence, and the outputs put back in order. Outside a step (decoding with a cache, the reference
model) they run as transformers' own."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from actors.engine.layout import current_layout

# the functions of a Gated DeltaNet layer's modeling module that carry state along the sequence
CONVOLUTION, DELTA_RULE = "causal_conv1d_forward", "torch_chunk_gated_delta_rule"
WRAPPED = "_aspen_per_sequence"   # set on a wrapper, pointing at the function it wraps


# a stateful layer's class name ends with: the functions of its modeling module that carry its state
STATEFUL = {"GatedDeltaNet": (CONVOLUTION, DELTA_RULE),   # Qwen3_5(Moe)GatedDeltaNet, Qwen3NextGatedDeltaNet
            "ShortConv": (CONVOLUTION,)}                   # Lfm2ShortConv, Lfm2MoeShortConv


def state_functions(module: nn.Module) -> tuple[str, ...]:
    """The state-carrying functions of a stateful layer (`STATEFUL`); () for any other module."""
    name = type(module).__name__
    return next((functions for suffix, functions in STATEFUL.items() if name.endswith(suffix)), ())


def _row_pieces(length: int) -> list[int] | None:
    """The lengths of the current step's sequences along a row of `length` tokens (a gap between or after them a
    piece of its own: none in today's layouts, whose padding forms sequences of its own); None outside a step, or
    where the row is one sequence. Made once a step for every stateful layer (kept with the step's layout)."""
    layout = current_layout()
    if layout is None or layout.num_tokens > length:
        return None
    key = ("row-pieces", length)
    if key not in layout.tensors:
        pieces, position = [], 0
        for start, end in layout.sequences:
            if start > position:
                pieces.append(start - position)
            pieces.append(end - start)
            position = end
        if position < length:
            pieces.append(length - position)
        layout.tensors[key] = pieces if len(pieces) > 1 else None
    return layout.tensors[key]


def _kept_eager(wrapper: Callable, original: Callable) -> Callable:
    """The wrapper, run eagerly under `compile: default` as the other functions that read the step's layout are
    (actors/engine/compiled.py: a graph cannot depend on the layout), marked as wrapping `original`."""
    eager = torch.compiler.disable(wrapper)
    setattr(eager, WRAPPED, original)
    return eager


def _per_sequence_convolution(original: Callable) -> Callable:
    def convolution(conv1d: nn.Conv1d, hidden_states: torch.Tensor, cache: Any, layer_idx: int,
                    activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        pieces = _row_pieces(hidden_states.shape[-1]) if cache is None and hidden_states.shape[0] == 1 else None
        if pieces is None:
            return original(conv1d, hidden_states, cache, layer_idx, activation=activation, **kwargs)
        return torch.cat([original(conv1d, piece, None, layer_idx, activation=activation, **kwargs)
                          for piece in hidden_states.split(pieces, dim=-1)], dim=-1)   # (1, channels, T)

    return _kept_eager(convolution, original)


def _per_sequence_delta_rule(original: Callable) -> Callable:
    def delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   *args: Any, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                   cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces = None
        if initial_state is None and not output_final_state and cu_seqlens is None and query.shape[0] == 1:
            pieces = _row_pieces(query.shape[1])
        if pieces is None:
            return original(query, key, value, g, beta, *args, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, **kwargs)
        outputs = [original(*parts, *args, initial_state=None, output_final_state=False, **kwargs)[0]
                   for parts in zip(*(tensor.split(pieces, dim=1) for tensor in (query, key, value, g, beta)),
                                    strict=True)]
        return torch.cat(outputs, dim=1), None   # (1, T, heads, value dim)

    return _kept_eager(delta_rule, original)


def use_per_sequence_state(model: nn.Module) -> bool:
    """Make the stateful layers of `model` run their state-carrying functions sequence by sequence in a fused step
    (module docstring); True where the model has such layers. Patched once per modeling module."""
    found = False
    wrappers = {CONVOLUTION: _per_sequence_convolution, DELTA_RULE: _per_sequence_delta_rule}
    for module in model.modules():
        functions = state_functions(module)
        found = found or bool(functions)
        modeling = sys.modules[type(module).__module__]
        for name in functions:
            function = getattr(modeling, name, None)
            if function is None:
                raise ValueError(f"{type(module).__name__}: its module {modeling.__name__} has no {name}, which "
                                 "aspen runs per sequence in a packed step; this transformers version is not the "
                                 "one aspen was verified with")
            if not hasattr(function, WRAPPED):
                setattr(modeling, name, wrappers[name](function))
    return found
