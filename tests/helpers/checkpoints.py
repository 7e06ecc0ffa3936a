"""A small job for the checkpoint tests, its weights, and a checkpoint in the old format 1."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from actors.checkpoint.peft_io import save_adapter
from actors.engine.job import TrainingJob
from actors.spec.job_spec import JobSpec

VOCAB = 300


def spec() -> JobSpec:
    return JobSpec(name="resumable", data="x", format={"type": "text"}, batch_size=3, grad_accum=2, max_steps=8,
                   lr=1e-2, lr_schedule="cosine", lora={"r": 4, "alpha": 8, "dropout": 0.3,
                                                        "target_modules": "all-linear"})


def weights(job: TrainingJob) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.adapter.named_parameters()}


def write_format_1(job: TrainingJob, folder: Path, optimizer_payload: object | None = None) -> None:
    """A checkpoint exactly as format 1 wrote it (torch.save'd optimizer.pt), or with another payload."""
    folder.mkdir(parents=True)
    save_adapter(job.adapter, folder, "tiny")
    generator = job.adapter.dropout_generator
    if optimizer_payload is None:
        optimizer_payload = {
            "optimizer": job.optimizer.state_dict(),
            "gradients": [None if p.grad is None else p.grad.detach().cpu() for p in job.adapter.parameters()],
            "dropout_rng": None if generator is None else generator.get_state(),
        }
    torch.save(optimizer_payload, folder / "optimizer.pt")
    state = {"format": 1, "job": job.name, "step": job.step, "total_steps": job.total_steps,
             "tokens_seen": job.tokens_seen, "cursor": job.data_position(), "accumulator": asdict(job.accumulator),
             "history": [asdict(record) for record in job.history]}
    (folder / "state.json").write_text(json.dumps(state, indent=1) + "\n")
