"""LoRA on the LM head (the Tinker API's `train_unembed`): an interactive model's adapter on the output
embedding, logits = head(h) + scaling * (h A^T) B^T, with A (r, d) and B (vocabulary, r) in float32 (B zero at
first, so a new adapter is the base). PEFT saves it as `lm_head.lora_A.weight` / `lm_head.lora_B.weight` with
`lm_head` among its target modules, and applies it the same way, tied embeddings or not (the input embedding
is never changed).

The head's adapters are kept on the model by adapter name (`attach`, `detach`, `head_adapter`), beside its
linear layers' (actors/engine/adapter_surgery.py). The frozen-head loss (actors/engine/loss.py) keeps no logits
and computes no weight gradient; an adapted head needs B's gradient, (softmax - one-hot)^T (h A^T), so its
log-probabilities go chunk by chunk under activation checkpointing: each chunk's logits are made in the
forward and again in the backward, and never exist whole. Each adapter's rows are its own (a call's, a
decoding row's), so one model's head gradient comes from its own tokens alone. A base's logits and
log-probabilities through an adapter's head: actors/engine/head_logits.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from actors.engine.lora_adapter import LoraAdapter
from actors.engine.loss import transform_logits
from actors.engine.model_support import LogitTransform
from actors.spec.lora_config import LoraConfig
from actors.spec.model_parts import HEAD_MODULE

HEAD_ADAPTERS = "_aspen_head_adapters"
CHUNK = 256   # rows a chunk: its float32 logits and their softmax are made twice (forward, backward)


class HeadLora:
    """One adapter's LoRA on the LM head: A (r, d), B (vocabulary, r), float32, and its scaling."""

    def __init__(self, rank: int, alpha: float, hidden: int, vocabulary: int, *, generator: torch.Generator,
                 device: torch.device):
        config = LoraConfig(r=rank, alpha=alpha, target_modules=[HEAD_MODULE])
        self.lora_A = nn.Parameter(LoraAdapter.initial_a(config, hidden, generator).to(device))
        self.lora_B = nn.Parameter(torch.zeros(vocabulary, rank, device=device))
        self.scaling = alpha / rank

    def delta(self, hidden: torch.Tensor) -> torch.Tensor:
        """scaling * (h A^T) B^T in float32: what the adapter adds to the head's output at `hidden` (M, d)."""
        return _update(hidden, self.lora_A, self.lora_B, self.scaling)


def _update(hidden: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    return (hidden.float() @ lora_a.t()) @ (lora_b.t() * scaling)


def attach(model: nn.Module, name: str, rank: int, alpha: float, *, generator: torch.Generator) -> HeadLora:
    """A new head adapter `name` on `model` (A drawn from `generator`, as PEFT draws a linear layer's)."""
    head = model.get_output_embeddings()
    held = model.__dict__.setdefault(HEAD_ADAPTERS, {})
    if name in held:
        raise ValueError(f"an adapter named '{name}' already has a head adapter")
    vocabulary, hidden = head.weight.shape
    held[name] = HeadLora(rank, alpha, hidden, vocabulary, generator=generator, device=head.weight.device)
    return held[name]


def detach(model: nn.Module, name: str) -> None:
    """Take adapter `name`'s head adapter off `model` (nothing where it has none)."""
    model.__dict__.get(HEAD_ADAPTERS, {}).pop(name, None)


def head_adapter(model: nn.Module, name: str | None) -> HeadLora | None:
    """Adapter `name`'s head adapter, or None (no such adapter, or one that leaves the head alone)."""
    return None if name is None else model.__dict__.get(HEAD_ADAPTERS, {}).get(name)


def held_names(model: nn.Module) -> set[str]:
    """The adapters with a head adapter on `model`."""
    return set(model.__dict__.get(HEAD_ADAPTERS, {}))


def raw_logits(head: nn.Module, adapter: HeadLora | None, hidden: torch.Tensor) -> torch.Tensor:
    """The head's output at `hidden` (M, d) through `adapter` (None: the head alone), float32."""
    raw = F.linear(hidden, head.weight, head.bias).float()
    return raw if adapter is None else raw + adapter.delta(hidden)


def _chunk_log_probs(hidden: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, targets: torch.Tensor,
                     head: nn.Module, scaling: float, transform: LogitTransform) -> torch.Tensor:
    raw = F.linear(hidden, head.weight, head.bias).float() + _update(hidden, lora_a, lora_b, scaling)
    return transform_logits(raw, transform, inplace=False).log_softmax(dim=-1).gather(1, targets[:, None]).squeeze(1)


def adapted_log_probs(hidden: torch.Tensor, head: nn.Module, adapter: HeadLora, targets: torch.Tensor,
                      transform: LogitTransform, chunk: int = CHUNK) -> torch.Tensor:
    """(M,) float32 log-probabilities of `targets` under the adapted head's logits at `hidden` (M, d),
    differentiable with respect to `hidden` and the adapter's A and B (module docstring: chunked, recomputed)."""
    pieces = []
    track = torch.is_grad_enabled() and (hidden.requires_grad or adapter.lora_A.requires_grad
                                         or adapter.lora_B.requires_grad)
    for start in range(0, hidden.shape[0], chunk):
        end = min(start + chunk, hidden.shape[0])
        arguments = (hidden[start:end], adapter.lora_A, adapter.lora_B, targets[start:end], head, adapter.scaling,
                     transform)
        pieces.append(checkpoint(_chunk_log_probs, *arguments, use_reentrant=False) if track
                      else _chunk_log_probs(*arguments))
    if not pieces:
        return hidden.sum(dim=-1).float() * 0.0
    return torch.cat(pieces)

