"""Job checkpoints: adapter (PEFT format), optimizer state and partial gradient accumulation, data
cursor position, dropout RNG state and metrics history, written atomically (a temporary folder, then a
rename), so that a resumed job ends with the same adapter as an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from actors.engine.job import OptimizerStepRecord, StepAccumulator, TrainingJob
from actors.engine.peft_io import load_adapter_weights, save_adapter

STATE_NAME = "state.json"
OPTIMIZER_NAME = "optimizer.pt"
FORMAT_VERSION = 1


def save_checkpoint(job: TrainingJob, folder: str | Path, base_model_name: str) -> Path:
    """Write the job's full training state to `folder`, replacing any previous checkpoint atomically."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        save_adapter(job.adapter, staging, base_model_name)
        generator = job.adapter.dropout_generator
        torch.save({
            "optimizer": job.optimizer.state_dict(),
            "gradients": [None if p.grad is None else p.grad.detach().cpu() for p in job.adapter.parameters()],
            "dropout_rng": None if generator is None else generator.get_state(),
        }, staging / OPTIMIZER_NAME)
        state = {
            "format": FORMAT_VERSION,
            "job": job.name,
            "step": job.step,
            "total_steps": job.total_steps,
            "tokens_seen": job.tokens_seen,
            "cursor": job.data_position(),
            "accumulator": asdict(job.accumulator),
            "history": [asdict(record) for record in job.history],
        }
        (staging / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")
        previous = folder.with_name(f".{folder.name}.previous")
        if previous.exists():
            shutil.rmtree(previous)
        if folder.exists():
            os.replace(folder, previous)
        os.replace(staging, folder)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


def has_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / STATE_NAME).is_file()


def load_checkpoint(job: TrainingJob, folder: str | Path) -> None:
    """Restore a freshly created job (same spec, same data) to the state saved in `folder`."""
    folder = Path(folder)
    state = json.loads((folder / STATE_NAME).read_text())
    if state.get("job") != job.name:
        raise ValueError(f"{folder}: checkpoint of job '{state.get('job')}', not of '{job.name}'")
    load_adapter_weights(job.adapter, folder)
    saved = torch.load(folder / OPTIMIZER_NAME, weights_only=False)
    job.optimizer.load_state_dict(saved["optimizer"])
    for parameter, gradient in zip(job.adapter.parameters(), saved["gradients"]):
        parameter.grad = None if gradient is None else gradient.to(parameter.device, parameter.dtype)
    generator = job.adapter.dropout_generator
    if generator is not None and saved["dropout_rng"] is not None:
        generator.set_state(saved["dropout_rng"])
    job.cursor.load_state_dict(state["cursor"])
    job.pending = None
    job.cursor_state_before_pending = None
    job.tokens_seen = state["tokens_seen"]
    job.accumulator = StepAccumulator(**state["accumulator"])
    job.history = [OptimizerStepRecord(**record) for record in state["history"]]
