"""Reading a checkpoint folder's files into memory, before any job: format 2's against the sizes and sha256
that state.json lists, format 1's optimizer.pt with torch.load(weights_only=True) only."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from actors.checkpoint.optimizer import decode_optimizer
from actors.checkpoint.peft_io import WEIGHTS_NAME
from actors.checkpoint.state import (
    BEST_NAME,
    LEGACY_OPTIMIZER_NAME,
    OPTIMIZER_NAME,
    REFERENCE_NAME,
    STATE_NAME,
    CheckpointState,
    CheckpointStateV2,
    Count,
    FileEntry,
    Invalid,
    describe,
)


@dataclass(kw_only=True)
class SavedCheckpoint:
    """A checkpoint read from its folder, its files consistent with its state.json; not yet checked
    against a job."""

    folder: Path
    state: CheckpointState
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # JobOptimizer.state_dict() form
    gradients: list[torch.Tensor | None]
    dropout_rng: torch.Tensor | None
    reference: dict[str, torch.Tensor] | None = None   # the job's reference adapter, where it has one (format 2)
    best: dict[str, torch.Tensor] | None = None   # a keep_best job's best evaluation's adapter, where it saved one

    @property
    def format(self) -> int:
        return self.state.format

    @property
    def tensors_path(self) -> Path:
        """The file holding the optimizer state and the gradients."""
        return self.folder / (OPTIMIZER_NAME if self.format == 2 else LEGACY_OPTIMIZER_NAME)


def read_files(folder: Path, state: CheckpointState) -> SavedCheckpoint:
    """The checkpoint in `folder` whose validated state.json is `state`; raises `Invalid` naming the file."""
    if isinstance(state, CheckpointStateV2):
        return _read_format_2(folder, state)
    return _read_format_1(folder, state)


def _read_format_2(folder: Path, state: CheckpointStateV2) -> SavedCheckpoint:
    files = state.files.by_name()
    contents = {name: _read_listed_file(folder / name) for name in sorted(files)}
    adapter = parse_tensors(folder / WEIGHTS_NAME, contents[WEIGHTS_NAME])
    tensors = parse_tensors(folder / OPTIMIZER_NAME, contents[OPTIMIZER_NAME])
    for name in sorted(files):
        _check_digest(folder / name, contents[name], files[name])
    dropout_rng = None
    if state.dropout_rng:
        if "dropout_rng" not in tensors:
            raise Invalid(f"{folder / OPTIMIZER_NAME}: tensor 'dropout_rng' is missing (state.json lists it)")
        dropout_rng = tensors.pop("dropout_rng")
    optimizer, gradients = decode_optimizer(folder / STATE_NAME, folder / OPTIMIZER_NAME, state.optimizer, tensors)
    reference = parse_tensors(folder / REFERENCE_NAME, contents[REFERENCE_NAME]) if REFERENCE_NAME in files else None
    best = None
    if state.best is not None:
        content = _read_listed_file(folder / BEST_NAME)
        _check_digest(folder / BEST_NAME, content, state.best.file)
        best = parse_tensors(folder / BEST_NAME, content)
    return SavedCheckpoint(folder=folder, state=state, adapter=adapter, optimizer=optimizer, gradients=gradients,
                           dropout_rng=dropout_rng, reference=reference, best=best)


def _read_listed_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise Invalid(f"{path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise Invalid(f"{path}: cannot be read ({error})") from error


def _check_digest(path: Path, content: bytes, entry: FileEntry) -> None:
    if len(content) != entry.bytes:
        raise Invalid(f"{path}: {len(content)} bytes, {entry.bytes} when it was saved (truncated or overwritten)")
    if hashlib.sha256(content).hexdigest() != entry.sha256:
        raise Invalid(f"{path}: its content differs from what was saved (sha256 mismatch: corrupted)")


def parse_tensors(path: Path, content: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(content)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise Invalid(f"{path}: truncated or corrupted safetensors file ({error})") from error


class _LegacyTorchOptimizer(BaseModel):
    """torch's optimizer state_dict, as format 1 saved it."""

    model_config = ConfigDict(extra="ignore")

    state: dict[Any, Any]
    param_groups: list[dict[str, Any]]


class _LegacyJobOptimizer(BaseModel):
    """`JobOptimizer.state_dict()`, as format 1 saved it."""

    model_config = ConfigDict(extra="ignore")

    optimizer: _LegacyTorchOptimizer
    step_count: Count
    micro_count: Count


class LegacyOptimizerFile(BaseModel):
    """Format 1's optimizer.pt: what must be there (the content itself is used as torch loaded it)."""

    model_config = ConfigDict(extra="ignore", arbitrary_types_allowed=True)

    optimizer: _LegacyJobOptimizer
    gradients: list[torch.Tensor | None]
    dropout_rng: torch.Tensor | None


def _read_format_1(folder: Path, state: CheckpointState) -> SavedCheckpoint:
    """A format-1 checkpoint (optimizer.pt), read with torch.load(weights_only=True): a file holding
    anything but tensors and plain values is refused, never unpickled."""
    weights_path = folder / WEIGHTS_NAME
    try:
        adapter = parse_tensors(weights_path, weights_path.read_bytes())
    except FileNotFoundError:
        raise Invalid(f"{weights_path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise Invalid(f"{weights_path}: cannot be read ({error})") from error
    path = folder / LEGACY_OPTIMIZER_NAME
    if not path.is_file():
        raise Invalid(f"{path}: missing (the checkpoint is incomplete)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()
        detail = next((line for line in reason if "Unsupported global" in line or "GLOBAL" in line),
                      reason[0] if reason else type(error).__name__)
        raise Invalid(f"{path}: refused: this format-1 optimizer state holds objects other than tensors and "
                      f"plain values, and nothing is unpickled from a job folder ({detail.strip()}); delete "
                      "this checkpoint (the job resumes from the other one, or starts over)") from error
    except Exception as error:  # any failure to read the file makes this checkpoint invalid
        raise Invalid(f"{path}: cannot be read ({type(error).__name__}: {error})") from error
    try:
        LegacyOptimizerFile.model_validate(saved)
    except ValidationError as error:
        raise Invalid(f"{path}: not a format-1 optimizer state (expected optimizer, gradients and dropout_rng): "
                      f"{describe(error)}") from None
    return SavedCheckpoint(folder=folder, state=state, adapter=adapter, optimizer=saved["optimizer"],
                           gradients=saved["gradients"], dropout_rng=saved["dropout_rng"])
