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
    state.json              format, job, step, cursor, accumulator, history, evals ([step, eval loss]
                            pairs; optional: older checkpoints have none), data_digest (of the data the
                            job trains on, data/digest.py; optional: older checkpoints, and jobs whose
                            data is not known, have none), the optimizer's non-tensor parts
                            (param_groups, step_count, micro_count, which tensors exist) and the size and
                            sha256 of every other file; written last
A job whose data digest differs from its checkpoint's is not resumed (`DataChanged`): its data changed
since. A checkpoint without a digest is resumed, and says that its data could not be checked.
One writer per checkpoint folder: a save removes the staging folders an earlier (crashed) save left."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from actors.engine.data.digest import describe_change
from actors.engine.durable import fsync_tree, replace_durably
from actors.engine.job import OptimizerStepRecord, StepAccumulator, TrainingJob
from actors.engine.peft_io import CONFIG_NAME, WEIGHTS_NAME, adapter_state_dict_shapes, load_adapter_state, save_adapter

log = logging.getLogger(__name__)

STATE_NAME = "state.json"
OPTIMIZER_NAME = "optimizer.safetensors"
LEGACY_OPTIMIZER_NAME = "optimizer.pt"  # format 1; read with torch.load(weights_only=True) only
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
STATE_KEYS = ("job", "step", "tokens_seen", "cursor", "accumulator", "history")
STATE_KEYS_V2 = STATE_KEYS + ("optimizer", "dropout_rng", "files")
REQUIRED_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay"}  # AdamW defaults the others
OPTIMIZER_KEYS_V2 = ("step_count", "micro_count", "param_groups", "state_tensors", "state_values", "gradients")


class CheckpointError(ValueError):
    """No valid checkpoint: the message names every candidate folder and why it was rejected."""


class DataChanged(ValueError):
    """The job's data is not what its checkpoint was trained on (their digests differ): the job must not
    resume from it. The message names the job, its data and what to do."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load_checkpoint` restored: the job's step, the folder it came from (the checkpoint or its
    `.previous`), its format, one message per checkpoint skipped on the way (path: why), and notes on what
    could not be checked (its data, where it records no digest)."""

    step: int
    folder: Path
    skipped: list[str] = field(default_factory=list)
    format: int = FORMAT_VERSION
    notes: list[str] = field(default_factory=list)


class _Invalid(Exception):
    """One candidate checkpoint is unusable; the message starts with the offending path."""


@dataclass
class _Saved:
    """A checkpoint read and validated against a job, not yet applied to it."""

    folder: Path
    format: int
    state: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # JobOptimizer.state_dict() form
    gradients: list[torch.Tensor | None]
    dropout_rng: torch.Tensor | None
    accumulator: StepAccumulator
    history: list[OptimizerStepRecord]
    evals: list[tuple[int, float]]


def previous_folder(folder: str | Path) -> Path:
    """Where the last complete checkpoint waits while a new one is swapped in."""
    folder = Path(folder)
    return folder.with_name(f".{folder.name}.previous")


def _staging_prefix(folder: Path) -> str:
    return f".{folder.name}.staging-"


# ---------------------------------------------------------------------------------------------- saving


def save_checkpoint(job: TrainingJob, folder: str | Path, base_model_name: str) -> Path:
    """Write the job's full training state to `folder`, replacing any previous checkpoint crash-safely:
    at every instant either `folder` or `.<name>.previous` holds a complete checkpoint. Returns `folder`."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(folder)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=_staging_prefix(folder)))
    try:
        _write_checkpoint(job, staging, base_model_name)
        fsync_tree(staging)
        _swap_in(staging, folder)
    except BaseException:
        _remove_tree(staging, "the staging folder of a failed checkpoint save")
        raise
    return folder


def _write_checkpoint(job: TrainingJob, staging: Path, base_model_name: str) -> None:
    save_adapter(job.adapter, staging, base_model_name)
    tensors: dict[str, torch.Tensor] = {}
    optimizer = _encode_optimizer(job, tensors)
    generator = job.adapter.dropout_generator
    if generator is not None:
        tensors["dropout_rng"] = generator.get_state().to("cpu", torch.uint8).contiguous().clone()
    data = save_safetensors(tensors, metadata={"format": "pt", "aspen_checkpoint": str(FORMAT_VERSION)})
    (staging / OPTIMIZER_NAME).write_bytes(data)
    files = {OPTIMIZER_NAME: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        content = (staging / name).read_bytes()
        files[name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
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
        "data_digest": job.data_digest,
        "optimizer": optimizer,
        "dropout_rng": generator is not None,
        "files": files,
    }
    (staging / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")


def _encode_optimizer(job: TrainingJob, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The optimizer's state as JSON, its tensors added to `tensors` (on the CPU)."""
    full = job.optimizer.state_dict()
    torch_state = full["optimizer"]
    param_groups = []
    for g, group in enumerate(torch_state["param_groups"]):
        param_groups.append({key: _encode_value(value, f"param_groups.{g}.{key}", tensors)
                             for key, value in group.items()})
    state_tensors: dict[str, list[str]] = {}
    state_values: dict[str, dict[str, Any]] = {}
    for param_id, entries in torch_state["state"].items():
        names, values = [], {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param_id}.{key}"] = value.detach().to("cpu").contiguous().clone()
                names.append(key)
            else:
                values[key] = _encode_value(value, f"state.{param_id}.{key}", tensors)
        state_tensors[str(param_id)] = names
        state_values[str(param_id)] = values
    gradients = []
    for i, parameter in enumerate(job.adapter.parameters()):
        gradients.append(parameter.grad is not None)
        if parameter.grad is not None:
            tensors[f"grad.{i}"] = parameter.grad.detach().to("cpu").contiguous().clone()
    encoded = {"step_count": full["step_count"], "micro_count": full["micro_count"], "param_groups": param_groups,
               "state_tensors": state_tensors, "state_values": state_values, "gradients": gradients}
    if "loss_scale" in full:   # float16 bases: the job's dynamic loss scale
        encoded["loss_scale"] = full["loss_scale"]
    return encoded


def _encode_value(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for an optimizer setting: tuples tagged {"tuple": [...]}, tensors stored under `name`."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": name}
    if isinstance(value, tuple):
        return {"tuple": [_encode_value(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode_value(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"optimizer value {name} = {value!r} ({type(value).__name__}) cannot be written to a "
                    "checkpoint: only numbers, strings, booleans, None, tuples, lists and tensors can")


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


# --------------------------------------------------------------------------------------------- loading


def has_checkpoint(folder: str | Path) -> bool:
    """True when `folder` or its `.previous` holds a state file (whether it is valid is `load`'s call)."""
    folder = Path(folder)
    return (folder / STATE_NAME).is_file() or (previous_folder(folder) / STATE_NAME).is_file()


def saved_step(folder: str | Path) -> int | None:
    """The step of the newest checkpoint whose state file reads (`folder`, else its `.previous`), without
    validating the rest: what to tell a user before a resume (`load_checkpoint` decides what is used)."""
    folder = Path(folder)
    for candidate in (folder, previous_folder(folder)):
        try:
            step = _read_state(candidate / STATE_NAME)["step"]
        except _Invalid:
            continue
        return int(step)
    return None


def load_checkpoint(job: TrainingJob, folder: str | Path) -> LoadedCheckpoint:
    """Restore a freshly created job (same spec, same data) from the newest valid checkpoint: `folder`,
    else its `.previous`. Each is validated fully before the job is touched. Raises CheckpointError,
    naming every candidate and why it was rejected, when none is valid (the job is then untouched)."""
    folder = Path(folder)
    skipped: list[str] = []
    for candidate in (folder, previous_folder(folder)):
        try:
            saved = _read_checkpoint(candidate, job)
            _restore(job, saved)
        except _Invalid as error:
            skipped.append(str(error))
            continue
        if skipped:
            log.warning("job %s: resumed from %s at step %d; skipped: %s", job.name, candidate, job.step,
                        "; ".join(skipped))
        notes = []
        if job.data_digest is not None and saved.state.get("data_digest") is None:
            notes.append(f"its checkpoint {candidate} records no digest of its data (written by an older aspen), so "
                         f"whether {job.spec.data} changed since could not be checked; its next checkpoint records it")
            log.warning("job %s: %s", job.name, notes[-1])
        return LoadedCheckpoint(step=job.step, folder=candidate, skipped=skipped, format=saved.format, notes=notes)
    raise CheckpointError(f"no valid checkpoint for job '{job.name}': {'; '.join(skipped)}. Start the job "
                          f"over, or put a valid checkpoint back in {folder}")


def _read_checkpoint(folder: Path, job: TrainingJob) -> _Saved:
    if not folder.is_dir():
        raise _Invalid(f"{folder}: {'not a folder' if folder.exists() else 'missing'}")
    state_path = folder / STATE_NAME
    state = _read_state(state_path)
    if state["job"] != job.name:
        raise _Invalid(f"{state_path}: a checkpoint of job '{state['job']}', not of '{job.name}'")
    _check_data(state, state_path, job)
    if state["format"] == 2:
        saved = _read_format_2(folder, state)
    else:
        saved = _read_format_1(folder, state)
    _check_against_job(saved, job)
    return saved


def _read_state(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _Invalid(f"{path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise _Invalid(f"{path}: cannot be read ({error})") from error
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _Invalid(f"{path}: not UTF-8 text ({error})") from error
    try:
        state = json.loads(text)
    except json.JSONDecodeError as error:
        body = text.rstrip()
        kind = "truncated JSON" if error.pos >= len(body) or not body.endswith("}") else "invalid JSON"
        raise _Invalid(f"{path}: {kind} ({error})") from error
    if not isinstance(state, dict):
        raise _Invalid(f"{path}: not a checkpoint state (a JSON object is expected, found "
                       f"{type(state).__name__})")
    version = state.get("format")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _Invalid(f"{path}: no format version (\"format\": {version!r})")
    if version not in READABLE_FORMATS:
        newer = " (written by a newer aspen; upgrade aspen to resume it)" if version > FORMAT_VERSION else ""
        raise _Invalid(f"{path}: format {version} is not one this aspen reads "
                       f"({', '.join(map(str, READABLE_FORMATS))}){newer}")
    expected = STATE_KEYS_V2 if version == 2 else STATE_KEYS
    missing = [key for key in expected if key not in state]
    if missing:
        raise _Invalid(f"{path}: keys missing: {', '.join(missing)}")
    for key in ("step", "tokens_seen"):
        if not _is_int(state[key]) or state[key] < 0:
            raise _Invalid(f"{path}: \"{key}\" is {state[key]!r}, not a count")
    if not isinstance(state["job"], str):
        raise _Invalid(f"{path}: \"job\" is {state['job']!r}, not a job name")
    for key, kind in (("cursor", dict), ("accumulator", dict), ("history", list)):
        if not isinstance(state[key], kind):
            raise _Invalid(f"{path}: \"{key}\" is a {type(state[key]).__name__}, not a {kind.__name__}")
    if not isinstance(state.get("data_digest"), str | None):
        raise _Invalid(f"{path}: \"data_digest\" is {state['data_digest']!r}, not a digest string")
    return state


def _check_data(state: dict[str, Any], state_path: Path, job: TrainingJob) -> None:
    """Raise `DataChanged` where the checkpoint's data digest and the job's are both known and differ."""
    saved, current = state.get("data_digest"), job.data_digest
    if saved is None or current is None or saved == current:
        return
    raise DataChanged(f"job '{job.name}': its data {job.spec.data} changed since its checkpoint at step "
                      f"{state['step']} ({state_path}): {describe_change(saved, current)}; resuming would train one "
                      "adapter on two datasets. Put back the data it trained on, or start the job over "
                      "(`aspen run --overwrite`; a service's job: submit it again)")


def saved_data_digest(folder: str | Path) -> tuple[int, str | None] | None:
    """The step and data digest (None: an older checkpoint records none) of the newest checkpoint whose
    state file reads (`folder`, else its `.previous`), without validating the rest; None without one."""
    folder = Path(folder)
    for candidate in (folder, previous_folder(folder)):
        try:
            state = _read_state(candidate / STATE_NAME)
        except _Invalid:
            continue
        return int(state["step"]), state.get("data_digest")
    return None


def _read_format_2(folder: Path, state: dict[str, Any]) -> _Saved:
    state_path = folder / STATE_NAME
    files = state["files"]
    if not isinstance(files, dict) or set(files) != {OPTIMIZER_NAME, WEIGHTS_NAME, CONFIG_NAME}:
        raise _Invalid(f"{state_path}: \"files\" should list {OPTIMIZER_NAME}, {WEIGHTS_NAME} and "
                       f"{CONFIG_NAME}, it lists {sorted(files) if isinstance(files, dict) else files!r}")
    contents = {name: _read_listed_file(folder / name, files[name]) for name in sorted(files)}
    adapter = _parse_tensors(folder / WEIGHTS_NAME, contents[WEIGHTS_NAME])
    tensors = _parse_tensors(folder / OPTIMIZER_NAME, contents[OPTIMIZER_NAME])
    for name in sorted(files):
        _check_digest(folder / name, contents[name], files[name])
    if not isinstance(state["dropout_rng"], bool):
        raise _Invalid(f"{state_path}: \"dropout_rng\" is {state['dropout_rng']!r}, not true or false")
    dropout_rng = None
    if state["dropout_rng"]:
        if "dropout_rng" not in tensors:
            raise _Invalid(f"{folder / OPTIMIZER_NAME}: tensor 'dropout_rng' is missing (state.json lists it)")
        dropout_rng = tensors.pop("dropout_rng")
    optimizer, gradients = _decode_optimizer(state_path, folder / OPTIMIZER_NAME, state["optimizer"], tensors)
    return _Saved(folder, 2, state, adapter, optimizer, gradients, dropout_rng,
                  *_read_progress(state_path, state))


def _read_listed_file(path: Path, entry: Any) -> bytes:
    if not isinstance(entry, dict) or not _is_int(entry.get("bytes")) or not isinstance(entry.get("sha256"), str):
        raise _Invalid(f"{path.parent / STATE_NAME}: the entry of {path.name} in \"files\" is {entry!r}, not "
                       "{\"bytes\": ..., \"sha256\": ...}")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise _Invalid(f"{path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise _Invalid(f"{path}: cannot be read ({error})") from error


def _check_digest(path: Path, content: bytes, entry: dict[str, Any]) -> None:
    if len(content) != entry["bytes"]:
        raise _Invalid(f"{path}: {len(content)} bytes, {entry['bytes']} when it was saved (truncated or "
                       "overwritten)")
    if hashlib.sha256(content).hexdigest() != entry["sha256"]:
        raise _Invalid(f"{path}: its content differs from what was saved (sha256 mismatch: corrupted)")


def _parse_tensors(path: Path, content: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(content)
    except (SafetensorError, ValueError, RuntimeError) as error:
        kind = "truncated or corrupted safetensors file"
        raise _Invalid(f"{path}: {kind} ({error})") from error


def _decode_optimizer(state_path: Path, tensors_path: Path, encoded: Any, tensors: dict[str, torch.Tensor]
                      ) -> tuple[dict[str, Any], list[torch.Tensor | None]]:
    """Rebuild JobOptimizer.state_dict() and the gradient list from state.json's "optimizer" section and
    the tensors; every tensor in the file must be accounted for."""
    if not isinstance(encoded, dict):
        raise _Invalid(f"{state_path}: \"optimizer\" is a {type(encoded).__name__}, not an object")
    missing = [key for key in OPTIMIZER_KEYS_V2 if key not in encoded]
    if missing:
        raise _Invalid(f"{state_path}: \"optimizer\" lacks {', '.join(missing)}")
    for key in ("step_count", "micro_count"):
        if not _is_int(encoded[key]) or encoded[key] < 0:
            raise _Invalid(f"{state_path}: optimizer {key} is {encoded[key]!r}, not a count")
    used: set[str] = set()

    def tensor(name: str) -> torch.Tensor:
        if name not in tensors:
            raise _Invalid(f"{tensors_path}: tensor '{name}' is missing (state.json lists it)")
        used.add(name)
        return tensors[name]

    def decode(value: Any, where: str) -> Any:
        if isinstance(value, list):
            return [decode(v, where) for v in value]
        if isinstance(value, dict):
            if set(value) == {"tuple"} and isinstance(value["tuple"], list):
                return tuple(decode(v, where) for v in value["tuple"])
            if set(value) == {"tensor"} and isinstance(value["tensor"], str):
                return tensor(value["tensor"])
            raise _Invalid(f"{state_path}: {where}: unknown encoded value {value!r}")
        return value

    groups = encoded["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _Invalid(f"{state_path}: optimizer param_groups is not a list of objects")
    param_groups = [{key: decode(value, f"param_groups[{g}].{key}") for key, value in group.items()}
                    for g, group in enumerate(groups)]
    state_tensors, state_values = encoded["state_tensors"], encoded["state_values"]
    if not isinstance(state_tensors, dict) or not isinstance(state_values, dict) \
            or set(state_tensors) != set(state_values):
        raise _Invalid(f"{state_path}: optimizer state_tensors and state_values should be objects with the "
                       "same parameter ids")
    torch_state: dict[int, dict[str, Any]] = {}
    for key in state_tensors:
        try:
            param_id = int(key)
        except ValueError:
            raise _Invalid(f"{state_path}: optimizer state of parameter id {key!r}, not a number") from None
        names, values = state_tensors[key], state_values[key]
        if not isinstance(names, list) or not isinstance(values, dict):
            raise _Invalid(f"{state_path}: optimizer state of parameter {key} is malformed")
        entries = {name: tensor(f"state.{key}.{name}") for name in names}
        entries.update({name: decode(value, f"state.{key}.{name}") for name, value in values.items()})
        torch_state[param_id] = entries
    flags = encoded["gradients"]
    if not isinstance(flags, list) or not all(isinstance(flag, bool) for flag in flags):
        raise _Invalid(f"{state_path}: optimizer gradients should be a list of true/false")
    gradients = [tensor(f"grad.{i}") if flag else None for i, flag in enumerate(flags)]
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise _Invalid(f"{tensors_path}: tensors state.json does not list: {', '.join(unexpected[:5])}"
                       f"{' ...' if len(unexpected) > 5 else ''}")
    optimizer = {"optimizer": {"state": torch_state, "param_groups": param_groups},
                 "step_count": encoded["step_count"], "micro_count": encoded["micro_count"]}
    if "loss_scale" in encoded:
        scale = encoded["loss_scale"]
        if not (isinstance(scale, dict) and set(scale) == {"scale", "clean_steps"}
                and isinstance(scale["scale"], (int, float)) and math.isfinite(scale["scale"]) and scale["scale"] > 0
                and _is_int(scale["clean_steps"]) and scale["clean_steps"] >= 0):
            raise _Invalid(f"{state_path}: optimizer loss_scale is {scale!r}; expected "
                           "{\"scale\": a positive number, \"clean_steps\": a count}")
        optimizer["loss_scale"] = scale
    return optimizer, gradients


def _read_format_1(folder: Path, state: dict[str, Any]) -> _Saved:
    """A format-1 checkpoint (optimizer.pt), read with torch.load(weights_only=True): a file holding
    anything but tensors and plain values is refused, never unpickled."""
    state_path = folder / STATE_NAME
    weights_path = folder / WEIGHTS_NAME
    try:
        adapter = _parse_tensors(weights_path, weights_path.read_bytes())
    except FileNotFoundError:
        raise _Invalid(f"{weights_path}: missing (the checkpoint is incomplete)") from None
    except OSError as error:
        raise _Invalid(f"{weights_path}: cannot be read ({error})") from error
    path = folder / LEGACY_OPTIMIZER_NAME
    if not path.is_file():
        raise _Invalid(f"{path}: missing (the checkpoint is incomplete)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()
        detail = next((line for line in reason if "Unsupported global" in line or "GLOBAL" in line),
                      reason[0] if reason else type(error).__name__)
        raise _Invalid(f"{path}: refused: this format-1 optimizer state holds objects other than tensors and "
                       f"plain values, and nothing is unpickled from a job folder ({detail.strip()}); delete "
                       "this checkpoint (the job resumes from the other one, or starts over)") from error
    except Exception as error:  # any failure to read the file makes this checkpoint invalid
        raise _Invalid(f"{path}: cannot be read ({type(error).__name__}: {error})") from error
    ok = (isinstance(saved, dict) and {"optimizer", "gradients", "dropout_rng"} <= set(saved)
          and isinstance(saved["optimizer"], dict)
          and {"optimizer", "step_count", "micro_count"} <= set(saved["optimizer"])
          and isinstance(saved["optimizer"]["optimizer"], dict)
          and {"state", "param_groups"} <= set(saved["optimizer"]["optimizer"])
          and isinstance(saved["optimizer"]["optimizer"]["state"], dict)
          and isinstance(saved["optimizer"]["optimizer"]["param_groups"], list)
          and all(isinstance(group, dict) for group in saved["optimizer"]["optimizer"]["param_groups"])
          and _is_int(saved["optimizer"]["step_count"]) and _is_int(saved["optimizer"]["micro_count"])
          and isinstance(saved["gradients"], list)
          and all(g is None or isinstance(g, torch.Tensor) for g in saved["gradients"])
          and (saved["dropout_rng"] is None or isinstance(saved["dropout_rng"], torch.Tensor)))
    if not ok:
        raise _Invalid(f"{path}: not a format-1 optimizer state (expected optimizer, gradients and dropout_rng)")
    return _Saved(folder, 1, state, adapter, saved["optimizer"], saved["gradients"], saved["dropout_rng"],
                  *_read_progress(state_path, state))


def _read_progress(state_path: Path, state: dict[str, Any]
                   ) -> tuple[StepAccumulator, list[OptimizerStepRecord], list[tuple[int, float]]]:
    try:
        accumulator = StepAccumulator(**state["accumulator"])
    except TypeError as error:
        raise _Invalid(f"{state_path}: \"accumulator\" is malformed ({error})") from error
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    fields = asdict(accumulator)
    sums = fields.pop("metric_sums")   # a preference job's metrics: a JSON object of numbers
    if not (all(number(v) for v in fields.values()) and isinstance(sums, dict)
            and all(isinstance(k, str) and number(v) for k, v in sums.items())):
        raise _Invalid(f"{state_path}: \"accumulator\" holds values that are not numbers: {state['accumulator']!r}")
    history = []
    for i, record in enumerate(state["history"]):
        if not isinstance(record, dict):
            raise _Invalid(f"{state_path}: history record {i} is not an object")
        try:
            history.append(OptimizerStepRecord(**record))
        except TypeError as error:
            raise _Invalid(f"{state_path}: history record {i} is malformed ({error})") from error
    return accumulator, history, _read_evals(state_path, state)


def _read_evals(state_path: Path, state: dict[str, Any]) -> list[tuple[int, float]]:
    """The job's eval losses up to the checkpoint's step ([] where an older checkpoint has none)."""
    raw = state.get("evals", [])
    if not isinstance(raw, list):
        raise _Invalid(f"{state_path}: \"evals\" is a {type(raw).__name__}, not a list of [step, eval loss]")
    evals = []
    for i, pair in enumerate(raw):
        ok = (isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and 0 <= pair[0] <= state["step"]
              and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool))
        if not ok:
            raise _Invalid(f"{state_path}: evals entry {i} is {pair!r}, not [step <= {state['step']}, eval loss]")
        evals.append((pair[0], float(pair[1])))
    return evals


def _check_against_job(saved: _Saved, job: TrainingJob) -> None:
    """Everything `_restore` relies on: shapes, counts and step numbers that agree."""
    state_path = saved.folder / STATE_NAME
    tensors_path = saved.folder / (OPTIMIZER_NAME if saved.format == 2 else LEGACY_OPTIMIZER_NAME)
    weights_path = saved.folder / WEIGHTS_NAME

    keys = adapter_state_dict_shapes(job.adapter)   # DoRA's magnitudes, PiSSA / OLoRA's A0 and B0 included
    missing = [key for key in keys if key not in saved.adapter]
    extra = [key for key in saved.adapter if key not in keys]
    if missing or extra:
        raise _Invalid(f"{weights_path}: saved with other target modules or another adapter kind ({len(missing)} "
                       f"tensors missing, {len(extra)} unexpected, e.g. {(missing + extra)[0]})")
    for key, shape in keys.items():
        if tuple(saved.adapter[key].shape) != shape:
            raise _Invalid(f"{weights_path}: '{key}' has shape {tuple(saved.adapter[key].shape)}, the adapter "
                           f"{shape} (another LoRA rank or init_lora_weights?)")

    step, step_count = saved.state["step"], saved.optimizer["step_count"]
    if step != step_count:
        raise _Invalid(f"{state_path}: step {step} but the optimizer state is at step {step_count} "
                       "(files of different checkpoints)")
    if saved.history and saved.history[-1].step != step:
        raise _Invalid(f"{state_path}: step {step} but the last history record is of step "
                       f"{saved.history[-1].step}")

    parameters = job.adapter.parameters()
    torch_state = saved.optimizer["optimizer"]
    groups, job_groups = torch_state["param_groups"], job.optimizer.optimizer.param_groups
    if len(groups) != len(job_groups):
        raise _Invalid(f"{tensors_path}: {len(groups)} optimizer parameter groups, the job has {len(job_groups)}")
    by_id: dict[int, torch.nn.Parameter] = {}
    for g, (group, job_group) in enumerate(zip(groups, job_groups, strict=True)):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(job_group["params"]) or not all(map(_is_int, ids)):
            raise _Invalid(f"{tensors_path}: optimizer group {g} holds {ids!r} parameter ids, the job's "
                           f"{len(job_group['params'])} parameters")
        missing = sorted(REQUIRED_GROUP_KEYS - set(group))
        if missing:
            raise _Invalid(f"{tensors_path}: optimizer group {g} lacks {', '.join(missing)}")
        by_id.update(zip(ids, job_group["params"], strict=True))
    if len(by_id) != len(parameters):
        raise _Invalid(f"{tensors_path}: the optimizer's parameter ids are not one per adapter parameter")
    state_ids = set(torch_state["state"])
    expected_ids = set(by_id) if step_count > 0 else set()
    if state_ids != expected_ids:
        raise _Invalid(f"{tensors_path}: optimizer state for {len(state_ids)} parameters, expected "
                       f"{len(expected_ids)} at step {step_count}")
    steps = []
    for param_id, entries in torch_state["state"].items():
        param = by_id[param_id]
        if not isinstance(entries, dict):
            raise _Invalid(f"{tensors_path}: optimizer state of parameter {param_id} is not a mapping")
        for key, value in entries.items():
            if key == "step":
                number = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if not isinstance(number, (int, float)) or isinstance(number, bool) or number > step_count:
                    raise _Invalid(f"{tensors_path}: optimizer state of parameter {param_id} is at step "
                                   f"{value!r}, the job at step {step_count}")
                steps.append(number)
            elif isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
                raise _Invalid(f"{tensors_path}: optimizer '{key}' of parameter {param_id} has shape "
                               f"{tuple(value.shape)}, the parameter {tuple(param.shape)}")
    if steps and max(steps) != step_count:
        raise _Invalid(f"{tensors_path}: the optimizer state is at step {max(steps):g}, the job at step "
                       f"{step_count} (files of different checkpoints)")

    if len(saved.gradients) != len(parameters):
        raise _Invalid(f"{tensors_path}: {len(saved.gradients)} gradients saved for {len(parameters)} parameters")
    for i, (gradient, param) in enumerate(zip(saved.gradients, parameters, strict=True)):
        if gradient is not None and tuple(gradient.shape) != tuple(param.shape):
            raise _Invalid(f"{tensors_path}: gradient {i} has shape {tuple(gradient.shape)}, the parameter "
                           f"{tuple(param.shape)}")

    generator = job.adapter.dropout_generator
    if saved.format == 2 and (generator is None) != (saved.dropout_rng is None):
        has = "has" if generator is not None else "has no"
        raise _Invalid(f"{tensors_path}: dropout RNG state {'missing' if saved.dropout_rng is None else 'saved'}"
                       f", but the job {has} LoRA dropout (another LoRA config?)")
    if generator is not None and saved.dropout_rng is not None:
        current = generator.get_state()
        if saved.dropout_rng.dtype != torch.uint8 or saved.dropout_rng.shape != current.shape:
            raise _Invalid(f"{tensors_path}: dropout RNG state of {saved.dropout_rng.dtype} "
                           f"{tuple(saved.dropout_rng.shape)}, the generator's is uint8 {tuple(current.shape)}")


def _restore(job: TrainingJob, saved: _Saved) -> None:
    """Apply a validated checkpoint. The cursor goes first: it checks the position against its data; when
    it refuses it, the cursor is put back and this candidate is invalid, with the job untouched."""
    before = job.cursor.state_dict()
    try:
        job.cursor.load_state_dict(saved.state["cursor"])
    except (ValueError, KeyError, TypeError) as error:
        job.cursor.load_state_dict(before)
        raise _Invalid(f"{saved.folder / STATE_NAME}: its data position does not fit this job's data "
                       f"({error})") from error
    try:
        load_adapter_state(job.adapter, saved.adapter, str(saved.folder / WEIGHTS_NAME))
        job.optimizer.load_state_dict(saved.optimizer)
        for parameter, gradient in zip(job.adapter.parameters(), saved.gradients, strict=True):
            parameter.grad = None if gradient is None else gradient.to(parameter.device, parameter.dtype)
        generator = job.adapter.dropout_generator
        if generator is not None and saved.dropout_rng is not None:
            generator.set_state(saved.dropout_rng)
    except Exception as error:
        raise RuntimeError(f"job '{job.name}' is half-restored from {saved.folder} although the checkpoint "
                           f"was validated ({type(error).__name__}: {error}); discard this job object and "
                           "report the bug") from error
    job.pending = None
    job.cursor_state_before_pending = None
    job.tokens_seen = saved.state["tokens_seen"]
    job.accumulator = saved.accumulator
    job.history = saved.history
    job.evals = saved.evals


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
