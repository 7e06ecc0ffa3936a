"""Memory estimates for admission: what one job's adapter costs on a trainer (fp32 weights, their
gradients and AdamW's two moments: 16 bytes per adapter parameter)."""

from __future__ import annotations

from actors.engine.lora import match_targets
from actors.engine.spec import LoraConfig

BYTES_PER_ADAPTER_PARAMETER = 4 * 4   # weight, gradient, AdamW exp_avg and exp_avg_sq, fp32 each


def adapter_parameters(lora: LoraConfig, linear_shapes: dict[str, tuple[int, int]]) -> int:
    """LoRA parameters of `lora` on a model whose linear layers have these (in, out) shapes."""
    names = match_targets(list(linear_shapes), lora.target_modules)
    return sum(lora.r * (linear_shapes[n][0] + linear_shapes[n][1]) for n in names)


def adapter_memory_bytes(lora: LoraConfig, linear_shapes: dict[str, tuple[int, int]]) -> int:
    return adapter_parameters(lora, linear_shapes) * BYTES_PER_ADAPTER_PARAMETER
