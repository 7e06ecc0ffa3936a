"""Checkpoint and resume against an uninterrupted run: same final adapter, mid-accumulation included."""

from __future__ import annotations

import torch

from actors.engine.checkpoint import has_checkpoint, load_checkpoint, save_checkpoint
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.spec import JobSpec
from actors.engine.trainer import FusedTrainer
from tests.conftest import random_examples, tiny_model

VOCAB = 300


def spec() -> JobSpec:
    return JobSpec(name="resumable", data="x", format={"type": "text"}, batch_size=3, grad_accum=2, max_steps=8,
                   lr=1e-2, lr_schedule="cosine", lora={"r": 4, "alpha": 8, "dropout": 0.3,
                                                        "target_modules": "all-linear"})


def neighbour() -> JobSpec:
    return JobSpec(name="neighbour", data="x", format={"type": "text"}, batch_size=2, max_steps=30)


def weights(job: TrainingJob) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.adapter.named_parameters()}


def test_resumed_job_ends_with_the_uninterrupted_adapter(tmp_path):
    base = from_module(tiny_model("llama", VOCAB), None)
    data = random_examples(0, count=10, vocab=VOCAB)
    other_data = random_examples(1, vocab=VOCAB)

    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, [], seed=0)
    trainer.add_job(job)
    while not job.done:
        trainer.train_step()
    uninterrupted, history = weights(job), [r.loss for r in job.history]
    trainer.remove_job(job.name)

    # Interrupted after 5 micro-batches (mid-accumulation, with a neighbour job sharing the steps).
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, [], seed=0)
    trainer.add_job(job)
    trainer.add_job(TrainingJob.create(neighbour(), base, other_data, [], seed=1))
    for _ in range(5):
        trainer.train_step()
    assert job.accumulator.micro_batches == 1 and job.peek() is not None
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    save_checkpoint(job, tmp_path / "ckpt", "tiny")  # overwriting an existing checkpoint works
    assert has_checkpoint(tmp_path / "ckpt") and not list(tmp_path.glob(".ckpt*"))
    for name in list(trainer.jobs):
        trainer.remove_job(name)

    trainer = FusedTrainer(base)
    resumed = TrainingJob.create(spec(), base, data, [], seed=0)
    load_checkpoint(resumed, tmp_path / "ckpt")
    trainer.add_job(resumed)
    while not resumed.done:
        trainer.train_step()
    assert resumed.step == 8
    assert [r.loss for r in resumed.history] == history
    final = weights(resumed)
    for key, value in uninterrupted.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-7)
