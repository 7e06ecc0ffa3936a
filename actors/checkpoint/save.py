"""Saving a job checkpoint crash-safely: written whole in a staging folder, fsynced, swapped in by renames
(`folder` -> `.<name>.previous`, staging -> `folder`).

The files are written from the tensors' own memory (safetensors' `save_file`), the CPU adapter and its moments
not copied first, so that a job's last writes add nothing of the adapter's size to a CPU trainer's resident set
(which its memory budget does not count); they run on the trainer's thread, between steps."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from actors.checkpoint.optimizer import encode_optimizer
from actors.checkpoint.peft_io import CONFIG_NAME, WEIGHTS_NAME, save_adapter
from actors.checkpoint.state import (
    BEST_NAME,
    FORMAT_VERSION,
    OPTIMIZER_NAME,
    REFERENCE_NAME,
    STATE_NAME,
    previous_folder,
)
from actors.engine.job import TrainingJob
from actors.storage.durable import fsync_tree, replace_durably, staging_folder, write_durably

log = logging.getLogger(__name__)


def save_checkpoint(job: TrainingJob, folder: str | Path, base_model_name: str, reference: Path | None = None,
                    metadata: dict | None = None) -> Path:
    """Write the job's full training state to `folder`, replacing any previous checkpoint crash-safely:
    at every instant either `folder` or `.<name>.previous` holds a complete checkpoint. Returns `folder`.
    `reference`: the safetensors file of the job's reference adapter (its copy in the job's folder), copied in
    as `reference_model.safetensors`, so that a resumed job needs nothing but its checkpoint. `metadata`: aspen's
    facts beside the adapter (`aspen.json`: where the base was loaded from), as the job's final adapter has them,
    so that an exported or merged checkpoint finds the base it was trained on."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(folder)
    staging = staging_folder(folder.parent, _staging_prefix(folder))
    try:
        _write_checkpoint(job, staging, base_model_name, reference, metadata)
        fsync_tree(staging)
        _swap_in(staging, folder)
    except BaseException:
        _remove_tree(staging, "the staging folder of a failed checkpoint save")
        raise
    return folder


def _staging_prefix(folder: Path) -> str:
    return f".{folder.name}.staging-"


def _write_checkpoint(job: TrainingJob, staging: Path, base_model_name: str, reference: Path | None,
                      metadata: dict | None) -> None:
    save_adapter(job.adapter, staging, base_model_name, metadata)
    if reference is not None:   # a file copy (synced with the folder below): no tensor of it in memory
        shutil.copyfile(reference, staging / REFERENCE_NAME)
    tensors: dict[str, torch.Tensor] = {}
    optimizer = encode_optimizer(job, tensors)
    generator = job.adapter.dropout_generator
    if generator is not None:
        tensors["dropout_rng"] = generator.get_state().to("cpu", torch.uint8).contiguous().clone()
    # written from the tensors' own memory (safetensors' save_file), not first serialized to bytes in memory; with
    # the mode any new file gets (safetensors makes its files 0600), as the adapter's beside it
    metadata = {"format": "pt", "aspen_checkpoint": str(FORMAT_VERSION)}
    write_durably(staging / OPTIMIZER_NAME, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    tensors.clear()   # the references to the job's tensors go before the digests are read
    best = job.best
    if best is not None:   # a keep_best job's best evaluation's adapter (host copies, written as they are)
        write_durably(staging / BEST_NAME, lambda tmp: save_file(best.tensors, tmp, metadata={"format": "pt"}))
    names = (OPTIMIZER_NAME, WEIGHTS_NAME, CONFIG_NAME) + ((REFERENCE_NAME,) if reference is not None else ())
    files = {name: _file_entry(staging / name) for name in names}
    state = {
        "format": FORMAT_VERSION,
        "job": job.name,
        "step": job.step,
        "total_steps": job.total_steps,
        "tokens_seen": job.tokens_seen,
        "cursor": job.data_position(),
        "accumulator": asdict(job.accumulator),
        "history": [asdict(record) for record in job.history],
        "evals": [[step, loss] for step, loss in job.evals],
        "scores": [[step, score] for step, score in job.scores],
        "data_digest": job.data_digest,
        "replay": job.replay.state() if job.replay is not None else None,
        "optimizer": optimizer,
        "dropout_rng": generator is not None,
        "files": files,
    }
    if best is not None:
        state["best"] = best.facts() | {"file": _file_entry(staging / BEST_NAME)}
    (staging / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")


def _file_entry(path: Path) -> dict[str, int | str]:
    """state.json's entry for a written file: its size and SHA-256, read back in blocks (not whole)."""
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def _swap_in(staging: Path, folder: Path) -> None:
    """Rename the complete, synced `staging` to `folder`, keeping the old checkpoint as `.previous` until
    the new one is in place and the rename is durable."""
    previous = previous_folder(folder)
    if folder.exists():
        if (folder / STATE_NAME).is_file():
            # `folder` is complete (it only ever appears by renaming a synced staging folder), so an
            # older `.previous` is no longer needed
            if previous.exists():
                shutil.rmtree(previous)
            replace_durably(folder, previous)
        else:
            # no state file: not a checkpoint (and `.previous`, if any, is the complete one to keep)
            shutil.rmtree(folder)
    replace_durably(staging, folder)
    if previous.exists():
        _remove_tree(previous, "the previous checkpoint (the new one is complete; the next save retries)")


def _remove_stale_staging(folder: Path) -> None:
    """Delete staging folders of this checkpoint left by a save that crashed."""
    prefix = _staging_prefix(folder)
    for path in folder.parent.iterdir():
        if path.name.startswith(prefix) and path.is_dir():
            log.warning("%s: removing the staging folder of an interrupted checkpoint save", path)
            _remove_tree(path, "the staging folder of an interrupted checkpoint save")


def _remove_tree(path: Path, what: str) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        log.warning("%s: could not delete %s: %s; delete it by hand if it stays", path, what, error)
