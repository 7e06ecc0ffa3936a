"""Memory estimates for admission: what one job's adapter costs on a trainer (fp32 weights, their
gradients and AdamW's two moments: 16 bytes per adapter parameter). Plain numbers in, plain numbers out:
which layers a LoRA config adapts is the engine's business (`actors.engine.lora.adapted_shapes`)."""

from __future__ import annotations

from collections.abc import Iterable

BYTES_PER_ADAPTER_PARAMETER = 4 * 4   # weight, gradient, AdamW exp_avg and exp_avg_sq, fp32 each


def adapter_parameters(rank: int, shapes: Iterable[tuple[int, int]]) -> int:
    """LoRA parameters of rank `rank` on linear layers of these (in, out) shapes: r x (in + out) each."""
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in shapes)


def adapter_memory_bytes(rank: int, shapes: Iterable[tuple[int, int]]) -> int:
    return adapter_parameters(rank, shapes) * BYTES_PER_ADAPTER_PARAMETER
