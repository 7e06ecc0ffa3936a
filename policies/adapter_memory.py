"""Memory estimates for admission: what one job's adapter costs on a trainer (fp32 weights, their
gradients and AdamW's two moments: 16 bytes per adapter parameter). DoRA's magnitude vector (one per output
row) is such a parameter; PiSSA / OLoRA also keep a frozen fp32 copy of the initial A and B (4 bytes per LoRA
parameter more). A VeRA adapter trains two vectors per layer (r and out values) and keeps one pair of frozen
fp32 projections (r x largest in, largest out x r). Plain numbers in, plain numbers out: which layers a LoRA
config adapts is the engine's
business (`actors.engine.lora_targets.adapted_shapes`)."""

from __future__ import annotations

from collections.abc import Iterable

BYTES_PER_ADAPTER_PARAMETER = 4 * 4   # weight, gradient, AdamW exp_avg and exp_avg_sq, fp32 each
BYTES_PER_FROZEN_VALUE = 4            # PiSSA / OLoRA's initial A0, B0: fp32 buffers, no gradient, no moments


def adapter_parameters(rank: int, shapes: Iterable[tuple[int, int]], *, dora: bool = False) -> int:
    """LoRA parameters of rank `rank` on linear layers of these (in, out) shapes: r x (in + out) each, and
    with DoRA `out` magnitudes each."""
    return sum(rank * (fan_in + fan_out) + (fan_out if dora else 0) for fan_in, fan_out in shapes)


def expert_parameters(rank: int, stacks: Iterable[tuple[int, int, int]]) -> int:
    """LoRA parameters of rank `rank` on MoE expert stacks of these (experts, in, out) shapes (PEFT's
    target_parameters): each expert its own r x (in + out)."""
    return sum(experts * rank * (fan_in + fan_out) for experts, fan_in, fan_out in stacks)


def vera_parameters(rank: int, shapes: Iterable[tuple[int, int]]) -> int:
    """VeRA's trainable values on layers of these (in, out) shapes: lambda_d (r) and lambda_b (out) each."""
    return sum(rank + fan_out for _, fan_out in shapes)


def adapter_memory_bytes(rank: int, shapes: Iterable[tuple[int, int]], *, dora: bool = False,
                         frozen_initial: bool = False, vera: bool = False, frozen_copy: bool = False,
                         best_copy: bool = False) -> int:
    """`frozen_copy`: the job also holds a frozen copy of its adapter's parameters (its reference model: fp32, no
    gradient, no moments; a VeRA copy shares the job's projections); `best_copy`: and a copy of them at its best
    evaluation (`keep_best`: fp32, counted where that copy's memory is the budget's, a CPU trainer's)."""
    shapes = list(shapes)
    copies = int(frozen_copy) + int(best_copy)
    if vera:
        projections = rank * (max(i for i, _ in shapes) + max(o for _, o in shapes)) if shapes else 0
        trained = vera_parameters(rank, shapes)
        return (trained * BYTES_PER_ADAPTER_PARAMETER + projections * BYTES_PER_FROZEN_VALUE
                + trained * BYTES_PER_FROZEN_VALUE * copies)
    frozen = adapter_parameters(rank, shapes) * BYTES_PER_FROZEN_VALUE if frozen_initial else 0
    trained = adapter_parameters(rank, shapes, dora=dora)
    return trained * BYTES_PER_ADAPTER_PARAMETER + frozen + trained * BYTES_PER_FROZEN_VALUE * copies
