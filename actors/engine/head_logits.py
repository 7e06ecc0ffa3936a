"""A base's logits and target log-probabilities through an adapter's LM head (actors/engine/head_lora.py: LoRA on
the head, an interactive model's `train_unembed`), or through the frozen head where the adapter leaves it alone:
what interactive calls' losses, prompt scores and decoding read."""

from __future__ import annotations

import torch

from actors.engine.head_lora import adapted_log_probs, head_adapter, raw_logits
from actors.engine.loss import target_log_probs, transform_logits
from actors.engine.models import BaseModel


def log_probs(base: BaseModel, hidden: torch.Tensor, targets: torch.Tensor, adapter: str | None) -> torch.Tensor:
    """(M,) float32 log-probabilities of `targets` at `hidden` (M, d) through adapter `adapter`'s head: the
    frozen head's chunked loss (actors/engine/loss.py) where it leaves the head alone."""
    head, lora = base.lm_head, head_adapter(base.model, adapter)
    if lora is None:
        return target_log_probs(hidden, head.weight, head.bias, targets, transform=base.logit_transform)
    return adapted_log_probs(hidden, head, lora, targets, base.logit_transform)


def logits(base: BaseModel, hidden: torch.Tensor, adapter: str | None) -> torch.Tensor:
    """The model's logits (float32) at `hidden` (M, d) through adapter `adapter`'s head."""
    return transform_logits(raw_logits(base.lm_head, head_adapter(base.model, adapter), hidden), base.logit_transform)


def row_logits(base: BaseModel, hidden: torch.Tensor, groups: list[tuple[str, int, int]]) -> torch.Tensor:
    """The model's logits (float32) at `hidden` (rows, d), rows `first:end` of each (name, first, end) group
    through that adapter's head (a decoding batch's rows: actors/engine/generate.py)."""
    held = [(head_adapter(base.model, name), first, end) for name, first, end in groups]
    if all(lora is None for lora, _, _ in held):
        return base.output_logits(hidden)
    raw = raw_logits(base.lm_head, None, hidden)
    for lora, first, end in held:
        if lora is not None:
            raw[first:end] += lora.delta(hidden[first:end])
    return transform_logits(raw, base.logit_transform)
