"""A job spec for the fused-training tests, the relative difference of two adapters, and one fused step's adapter
gradients."""

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


def first_step_gradients(trainer) -> dict[tuple[str, str], torch.Tensor]:
    """The adapter gradients of the trainer's next fused step, per (job, parameter name), as the optimizers get
    them (before they divide and step them)."""
    from actors.engine import trainer as trainer_module

    captured: dict[tuple[str, str], torch.Tensor] = {}
    original = trainer_module.step_jobs

    def capture(optimizers, targets, **options):
        for job in trainer.jobs.values():
            captured.update({(job.name, n): p.grad.clone() for n, p in job.adapter.named_parameters()})
        return original(optimizers, targets, **options)

    trainer_module.step_jobs = capture
    try:
        trainer.run_step(trainer.compose())
    finally:
        trainer_module.step_jobs = original
    return captured
