"""`compile: default`: the fused step's decoder layers under `torch.compile`, with the packed stream padded up to
a bucket length so that the number of compiled shapes stays bounded.

What is compiled and what is not. Each decoder layer's forward is compiled (static shapes: one graph per bucket
length). The two parts of a layer that read the step's layout (which adapter owns which tokens, where each packed
sequence starts and ends: Python numbers that change every step) run eagerly, behind `torch.compiler.disable`
(switched in for the step's forward only, so that importing the engine does not import torch._dynamo): the fused
LoRA linear layers (`FusedLoraLinear.forward`: the base product, one matrix product, and the adapters' updates)
and the varlen attention. The graph breaks around them; what is compiled is the layout-free rest (the norms, the
rotary embedding, the MLP's activation, the residual additions), whose shapes depend on the stream's length only.
So new segment bounds or new sequence lengths never recompile: a new bucket does, and so does a new set of layers
whose outputs need a gradient (the union of the step's jobs' target_modules: a few per run); the buckets are few
(`bucket_length`).

Padding and isolation. The padding tokens are appended after the last job's tokens as sequences of their own (each
no longer than the step's longest real sequence, so their positions stay within what the real rows use), inside no
job's segment (no adapter runs on them: their adapter rows are zeros) and with no targets (the loss never reads
them). Every other operation of a layer is token-wise (the projections, norms and MLP: row by row) or within one
sequence (the attention is block-diagonal over the sequences), so no real token reads a padding token, forward or
backward, and the padding's gradients reach no adapter. (A padded matrix product may pick another blocking than
the unpadded one: the jobs' numbers then agree to rounding, not bit for bit.)

Not offered together with it (refused with the fix): `recompute: layers` (its checkpoint wraps the layers this
compiles) and a quantized base (bitsandbytes' layers do not trace)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from actors.engine.attention import ATTENTION_NAME, varlen_attention_forward
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout
from actors.engine.packing import FusedBatch
from actors.engine.recompute import decoder_layers
from actors.spec.base_settings import COMPILE_MODES
from actors.spec.trainer_settings import compile_problem

_LORA_FORWARD = FusedLoraLinear.forward
MIN_BUCKET = 64
STEPS_PER_OCTAVE = 4   # bucket lengths 4, 5, 6, 7 x 2^k: at most a fifth of a padded stream is padding


def bucket_length(tokens: int) -> int:
    """The smallest bucket length >= `tokens`: MIN_BUCKET, else m * 2^k with m in 4..7 (64, 80, 96, 112, 128,
    160, ...): STEPS_PER_OCTAVE buckets per doubling, so tokens from 64 to 8192 fall into 29 buckets and a
    stream is padded by less than a quarter of its length."""
    if tokens <= MIN_BUCKET:
        return MIN_BUCKET
    power = 1 << ((tokens - 1).bit_length() - 1)          # the largest power of two below `tokens`
    step = max(power // STEPS_PER_OCTAVE, 1)
    return -(-tokens // step) * step


def buckets_between(low: int, high: int) -> list[int]:
    """Every bucket length a stream of `low`..`high` tokens may be padded to."""
    out: list[int] = []
    tokens = low
    while tokens <= high:
        bucket = bucket_length(tokens)
        out.append(bucket)
        tokens = bucket + 1
    return out


def pad_to_bucket(batch: FusedBatch, pad_token_id: int) -> FusedBatch:
    """`batch` with padding tokens appended up to its bucket length: sequences of their own (none longer than
    the step's longest sequence), in no job's segment, with no targets (see the module's isolation argument)."""
    length = batch.num_tokens
    padding = bucket_length(length) - length
    if padding == 0:
        return batch
    longest = max(batch.layout.max_sequence_length, 1)
    sequences = list(batch.layout.sequences)
    positions = []
    start = length
    while start < length + padding:
        end = min(start + longest, length + padding)
        sequences.append((start, end))
        positions.append(torch.arange(end - start, dtype=batch.position_ids.dtype))
        start = end
    device = batch.input_ids.device
    input_ids = torch.cat([batch.input_ids, torch.full((padding,), pad_token_id, dtype=batch.input_ids.dtype,
                                                       device=device)])
    position_ids = torch.cat([batch.position_ids, torch.cat(positions).to(device)])
    layout = StepLayout(batch.layout.segments, tuple(sequences), length + padding)
    return dataclasses.replace(batch, input_ids=input_ids, position_ids=position_ids, layout=layout,
                               padding_tokens=batch.padding_tokens + padding)


def check_compile(compile: str, *, recompute: str, quantization: str, layout: str = "packed") -> None:
    """Refuse a compile mode, or a combination, that is not offered (the fields and the fix named)."""
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, not '{compile}'")
    problem = compile_problem(compile, recompute=recompute, quantization=quantization, layout=layout)
    if problem is not None:
        raise ValueError(problem)


def _layer_forward(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(layer).forward(layer, *args, **kwargs)


_EAGER: dict[str, Callable[..., Any]] = {}   # the layout-reading functions behind torch.compiler.disable, made once


@contextlib.contextmanager
def _layout_readers_eager() -> Iterator[None]:
    """While open, the fused LoRA linear layers and the varlen attention run eagerly under torch.compile (the same
    function objects every step: the compiled graphs' guards on them hold)."""
    if not _EAGER:
        _EAGER["lora"] = torch.compiler.disable(FusedLoraLinear.forward)
        _EAGER["attention"] = torch.compiler.disable(varlen_attention_forward)
    AttentionInterface.register(ATTENTION_NAME, _EAGER["attention"])
    FusedLoraLinear.forward = _EAGER["lora"]
    try:
        yield
    finally:
        FusedLoraLinear.forward = _LORA_FORWARD
        AttentionInterface.register(ATTENTION_NAME, varlen_attention_forward)


class CompiledLayers:
    """The compiled forwards of a decoder's layers, switched in around one step's forward pass (`active`), so that
    evaluation and generation (unpadded, any length) stay eager. `backend`: torch.compile's backend ("inductor";
    "aot_eager" in the CPU tests: the same graphs, no code generation)."""

    def __init__(self, decoder: nn.Module, *, backend: str | Callable = "inductor", recompile_limit: int = 2048):
        self.layers = decoder_layers(decoder)
        self.backend = backend
        # graphs one piece of code may hold: (bucket lengths) x (which of its tensors need a gradient: the first
        # layer's input does not, and it depends on the adapted layers); past it torch runs the piece eagerly
        self.recompile_limit = recompile_limit
        # one compiled function for every layer, the layer an argument: layers of one class share their graphs
        self._run = torch.compile(_layer_forward, backend=backend, dynamic=False, fullgraph=False)

    def _forward(self, layer: nn.Module) -> Callable[..., Any]:
        return functools.partial(self._run, layer)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        patched = []
        with torch._dynamo.config.patch(recompile_limit=self.recompile_limit,
                                        accumulated_recompile_limit=4 * self.recompile_limit), _layout_readers_eager():
            try:
                for layer in self.layers:
                    layer.forward = self._forward(layer)   # an instance attribute, removed below
                    patched.append(layer)
                yield
            finally:
                for layer in patched:
                    del layer.forward
