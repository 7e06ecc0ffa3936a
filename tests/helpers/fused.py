"""A job spec for the fused-training tests and the relative difference of two adapters."""

from __future__ import annotations

import torch

from actors.spec.job_spec import JobSpec

VOCAB = 300


def job_spec(name: str, **overrides) -> JobSpec:
    fields = dict(name=name, data="unused.jsonl", format={"type": "text"}, batch_size=3, max_steps=20, lr=5e-3,
                  lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}, lr_schedule="cosine", warmup_steps=2)
    fields.update(overrides)
    return JobSpec(**fields)


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    den = sum(float((a[k] ** 2).sum()) for k in a) ** 0.5
    return num / den
