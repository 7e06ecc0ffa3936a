"""Where a base model's decoder is cut into pipeline stages: an explicit split, or one balanced by each
layer's measured time and memory.

A split is the number of decoder layers each stage holds, in order (e.g. [11, 10, 9]); stage 0 also holds
the token embeddings, the last stage the final norm, the LM head and the loss. Balancing measures, on the
trainer's own device, a probe step's forward and backward time of every layer, of the embeddings and of the
head with its loss, and each layer's weight bytes, then cuts the layers into contiguous stages so that the
slowest stage is as fast as it can be (ties: the stage with the most memory as small as it can be): a
pipeline runs at the pace of its slowest stage."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from actors.engine.adapter_surgery import add_adapter, remove_adapter
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.models import BaseModel
from actors.engine.recompute import decoder_layers
from actors.spec.lora_config import LoraConfig


@dataclass(frozen=True, kw_only=True)
class LayerCosts:
    """Measured per decoder layer: `seconds` (forward + backward of the probe) and `bytes` (weights); and
    the extra work of stage 0 (embeddings) and of the last stage (final norm, LM head and loss)."""

    seconds: tuple[float, ...]
    bytes: tuple[int, ...]
    first_seconds: float = 0.0
    last_seconds: float = 0.0
    first_bytes: int = 0
    last_bytes: int = 0


def check_split(split: list[int], layers: int, stages: int) -> list[int]:
    """An explicit split, checked: `stages` positive counts summing to the decoder's `layers`."""
    if len(split) != stages:
        raise ValueError(f"pipeline split {split} has {len(split)} entries for {stages} stages: give one layer "
                         "count per stage")
    if any(count < 1 for count in split):
        raise ValueError(f"pipeline split {split}: every stage needs at least one decoder layer")
    if sum(split) != layers:
        raise ValueError(f"pipeline split {split} holds {sum(split)} decoder layers; the model has {layers}: "
                         "the counts must sum to the model's number of layers")
    return list(split)


def even_split(layers: int, stages: int) -> list[int]:
    """As even as whole layers allow, the later stages one layer shorter (the last also holds the head)."""
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for a decoder of {layers} layers: at most one stage per layer")
    base, extra = divmod(layers, stages)
    return [base + (1 if stage < extra else 0) for stage in range(stages)]


def balanced_split(costs: LayerCosts, stages: int) -> list[int]:
    """Contiguous stages minimising the slowest stage's time (then its memory), by dynamic programming over
    the cut points."""
    layers = len(costs.seconds)
    if stages > layers:
        raise ValueError(f"{stages} pipeline stages for a decoder of {layers} layers: at most one stage per layer")
    time_prefix = [0.0]
    byte_prefix = [0]
    for seconds, size in zip(costs.seconds, costs.bytes, strict=True):
        time_prefix.append(time_prefix[-1] + seconds)
        byte_prefix.append(byte_prefix[-1] + size)

    def stage_cost(stage: int, start: int, end: int) -> tuple[float, int]:
        seconds = time_prefix[end] - time_prefix[start]
        size = byte_prefix[end] - byte_prefix[start]
        if stage == 0:
            seconds, size = seconds + costs.first_seconds, size + costs.first_bytes
        if stage == stages - 1:
            seconds, size = seconds + costs.last_seconds, size + costs.last_bytes
        return seconds, size

    # best[s][i]: the best (max seconds, max bytes) of stages 0..s-1 over layers 0..i-1, and its cut
    inf = (float("inf"), 1 << 62)
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for stage in range(1, stages + 1):
        for end in range(stage, layers - (stages - stage) + 1):
            for start in range(stage - 1, end):
                if best[stage - 1][start] == inf:
                    continue
                seconds, size = stage_cost(stage - 1, start, end)
                candidate = (max(best[stage - 1][start][0], seconds), max(best[stage - 1][start][1], size))
                if candidate < best[stage][end]:
                    best[stage][end] = candidate
                    cut[stage][end] = start
    split, end = [], layers
    for stage in range(stages, 0, -1):
        start = cut[stage][end]
        split.append(end - start)
        end = start
    return split[::-1]


def _timed(work, device: torch.device, repeats: int) -> float:
    work()   # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats


def _weight_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


PROBE = "aspen-split-probe"   # the adapter a measurement attaches for its duration


def measure_layer_costs(base: BaseModel, tokens: int = 512, repeats: int = 2) -> LayerCosts:
    """Time each decoder layer's forward and backward on a probe of `tokens` random hidden states (one
    packed sequence, through a probe adapter of rank 8 on every linear layer, as jobs' tokens go through
    theirs), the embeddings' lookup, and the final norm, LM head and loss; weigh each part's weights.
    `base` is held whole on its device (before it is cut)."""
    decoder = base.decoder
    layers = decoder_layers(decoder)
    embeddings, head = decoder.get_input_embeddings(), base.lm_head
    sizes = tuple(_weight_bytes(layer) for layer in layers)
    first_bytes, last_bytes = _weight_bytes(embeddings), _weight_bytes(decoder.norm) + _weight_bytes(head)
    device, dtype = base.device, base.dtype
    positions = torch.arange(tokens, device=device)[None]
    probe = torch.randn(1, tokens, base.model.config.hidden_size, device=device, dtype=dtype)
    rotary = decoder.rotary_emb(probe, positions)
    layout = StepLayout.single(PROBE, [tokens])
    add_adapter(base.model, PROBE, LoraConfig(r=8, alpha=16, target_modules="all-linear"), seed=0)
    try:
        seconds = []
        for layer in layers:
            def run(layer=layer):
                x = probe.detach().requires_grad_(True)
                with step_layout(layout):
                    out = layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
                out = out[0] if isinstance(out, tuple) else out
                out.float().sum().backward()
            seconds.append(_timed(run, device, repeats))
    finally:
        remove_adapter(base.model, PROBE)
    ids = torch.randint(0, base.model.config.vocab_size, (1, tokens), device=device)
    first = _timed(lambda: embeddings(ids), device, repeats)
    weights = torch.ones(tokens, device=device)

    def run_head():
        x = probe[0].detach().requires_grad_(True)
        total, _ = target_cross_entropy(decoder.norm(x), head.weight, head.bias, ids[0], weights)
        total.backward()
    last = _timed(run_head, device, repeats)
    return LayerCosts(seconds=tuple(seconds), bytes=sizes, first_seconds=first, last_seconds=last,
                      first_bytes=first_bytes, last_bytes=last_bytes)
