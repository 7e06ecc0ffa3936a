"""A model laid out as in the Hugging Face hub's cache, offline: its revision, offline mode as a serving
machine sets it, and token ids to compare logits on."""

from __future__ import annotations

import torch

from tests.helpers.models import random_examples

REVISION = "0123456789abcdef0123456789abcdef01234567"   # the snapshot a test's hub cache holds


def offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1, as a serving machine without the hub sets it before it starts (huggingface_hub reads
    it once, at import)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def sample_ids(count: int = 2, length: int = 24) -> torch.Tensor:
    return torch.tensor([list(e.input_ids) for e in random_examples(11, count=count, min_len=length, max_len=length)])
