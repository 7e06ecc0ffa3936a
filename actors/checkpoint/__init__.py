"""Job checkpoints that a crash never loses: the adapter (PEFT format), the optimizer state and partial
gradient accumulation, the data cursor position, the dropout RNG state, the metrics history and the eval
losses, so that a resumed job ends with the same adapter as an uninterrupted one (and its stop rule sees
the same loss history).

Saving writes a complete checkpoint into a staging folder next to the checkpoint, fsyncs every file and
the folder, then swaps it in with renames (`folder` -> `.<name>.previous`, staging -> `folder`) and only
then deletes `.previous`: at every instant a complete checkpoint exists on disk. Loading validates a
checkpoint fully before it touches the job, and falls back to `.previous` when `folder` is missing or
invalid. Nothing in a job folder is ever unpickled: format 2 is safetensors + JSON, and format-1
checkpoints (`optimizer.pt`) are read only with `torch.load(weights_only=True)`.

Format 2 on disk (`<name>/`):
    adapter_config.json, adapter_model.safetensors   the adapter, loadable by PEFT (DoRA's magnitudes and
                            PiSSA / OLoRA's frozen A0, B0 included: peft_io)
    optimizer.safetensors   tensors: `state.<id>.<key>` (AdamW exp_avg / exp_avg_sq / step per parameter),
                            `grad.<i>` (partial accumulation, where not None), `dropout_rng` (uint8),
                            `param_groups.<g>.<key>` (tensor-valued optimizer settings, if any)
    reference_model.safetensors   a job's frozen reference adapter (`JobSpec.reference_adapter`: the
                            init_adapter it compares itself with), PEFT's keys, so that a resumed job needs
                            only its checkpoint; absent for other jobs and in older checkpoints
    state.json              format, job, step, cursor, accumulator, history, evals ([step, eval loss]
                            pairs) and scores ([step, eval_generate score] pairs; both optional: older
                            checkpoints have none), data_digest (of the data the
                            job trains on, data/digest.py; optional: older checkpoints, and jobs whose
                            data is not known, have none), the optimizer's non-tensor parts
                            (param_groups, step_count, micro_count, which tensors exist) and the size and
                            sha256 of every other file; written last. Its pydantic models: `state`.
A job whose data digest differs from its checkpoint's is not resumed (`DataChanged`): its data changed
since. A checkpoint without a digest is resumed, and says that its data could not be checked.
One writer per checkpoint folder: a save removes the staging folders an earlier (crashed) save left.

Its parts: `state` (file names, state.json's models and reading it), `optimizer` (the optimizer state as
JSON + tensors, and back), `save`, `read` (a folder's files into memory), `load` (checks against the job,
restoring, the fallback to `.previous`)."""

from __future__ import annotations

import importlib
from typing import Any

# what needs only state.json (`aspen run` asks it of every job before anything starts): light, at once
from actors.checkpoint.state import (
    FORMAT_VERSION,
    OPTIMIZER_NAME,
    STATE_NAME,
    previous_folder,
    saved_data_digest,
    saved_step,
)

# loading and saving (torch, the adapter's modules): imported on first use
_LAZY = {"CheckpointError": "load", "DataChanged": "load", "LoadedCheckpoint": "load", "has_checkpoint": "load",
         "load_checkpoint": "load", "save_checkpoint": "save"}

__all__ = [
    "FORMAT_VERSION",
    "OPTIMIZER_NAME",
    "STATE_NAME",
    "CheckpointError",
    "DataChanged",
    "LoadedCheckpoint",
    "has_checkpoint",
    "load_checkpoint",
    "previous_folder",
    "save_checkpoint",
    "saved_data_digest",
    "saved_step",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
