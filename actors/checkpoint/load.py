"""Loading a job checkpoint: the newest valid one (`folder`, else `.previous`), checked against the job
before the job is touched (name, data digest, steps, shapes), then restored."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.checkpoint.peft_io import WEIGHTS_NAME, adapter_state_dict_shapes, load_adapter_state
from actors.checkpoint.read import SavedCheckpoint, read_files
from actors.checkpoint.state import (
    BEST_NAME,
    FORMAT_VERSION,
    REFERENCE_NAME,
    STATE_NAME,
    CheckpointState,
    CheckpointStateV2,
    Invalid,
    previous_folder,
    read_state,
)
from actors.data.digest import describe_change
from actors.engine.grpo_replay import GrpoReplay
from actors.engine.job import TrainingJob
from actors.engine.kept_best import KeptBest

log = logging.getLogger(__name__)

REQUIRED_GROUP_KEYS = {"params", "lr", "betas", "eps", "weight_decay"}  # AdamW defaults the others


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
    reference: dict[str, torch.Tensor] | None = None   # its reference adapter's tensors, where it saved them


def has_checkpoint(folder: str | Path) -> bool:
    """True when `folder` or its `.previous` holds a state file (whether it is valid is `load`'s call)."""
    folder = Path(folder)
    return (folder / STATE_NAME).is_file() or (previous_folder(folder) / STATE_NAME).is_file()


def load_checkpoint(job: TrainingJob, folder: str | Path) -> LoadedCheckpoint:
    """Restore a freshly created job (same spec, same data) from the newest valid checkpoint: `folder`,
    else its `.previous`. Each is validated fully before the job is touched. Raises CheckpointError,
    naming every candidate and why it was rejected, when none is valid (the job is then untouched), and
    DataChanged when the job's data is not what the checkpoint trained on."""
    folder = Path(folder)
    skipped: list[str] = []
    for candidate in (folder, previous_folder(folder)):
        try:
            saved = _read_checkpoint(candidate, job)
            _restore(job, saved)
        except Invalid as error:
            skipped.append(str(error))
            continue
        if skipped:
            log.warning("job %s: resumed from %s at step %d; skipped: %s", job.name, candidate, job.step,
                        "; ".join(skipped))
        notes = []
        if job.data_digest is not None and saved.state.data_digest is None:
            notes.append(f"its checkpoint {candidate} records no digest of its data (written by an older aspen), so "
                         f"whether {job.spec.data} changed since could not be checked; its next checkpoint records it")
            log.warning("job %s: %s", job.name, notes[-1])
        reference = saved.reference if job.spec.reference_adapter else None
        return LoadedCheckpoint(step=job.step, folder=candidate, skipped=skipped, format=saved.format, notes=notes,
                                reference=reference)
    raise CheckpointError(f"no valid checkpoint for job '{job.name}': {'; '.join(skipped)}. Start the job "
                          f"over, or put a valid checkpoint back in {folder}")


def _read_checkpoint(folder: Path, job: TrainingJob) -> SavedCheckpoint:
    """The checkpoint in `folder`, read and checked against `job`; raises `Invalid` (or `DataChanged`)."""
    if not folder.is_dir():
        raise Invalid(f"{folder}: {'not a folder' if folder.exists() else 'missing'}")
    state_path = folder / STATE_NAME
    state = read_state(state_path)
    if state.job != job.name:
        raise Invalid(f"{state_path}: a checkpoint of job '{state.job}', not of '{job.name}'")
    _check_data(state, state_path, job)
    saved = read_files(folder, state)
    _check_steps(saved)
    _check_adapter(saved, job)
    _check_optimizer(saved, job)
    _check_dropout_rng(saved, job)
    _check_replay(saved, job)
    _check_best(saved, job)
    return saved


def _check_best(saved: SavedCheckpoint, job: TrainingJob) -> None:
    """A best evaluation's adapter has the job's adapter's tensors and shapes, from a step the checkpoint has
    reached."""
    state = saved.state
    if saved.best is None or not isinstance(state, CheckpointStateV2) or state.best is None:
        return
    path = saved.folder / BEST_NAME
    if state.best.step > state.step:
        raise Invalid(f"{saved.folder / STATE_NAME}: best.step {state.best.step} is past the checkpoint's step "
                      f"{state.step}")
    expected = adapter_state_dict_shapes(job.adapter)
    shapes = {key: tuple(tensor.shape) for key, tensor in saved.best.items()}
    if shapes != expected:
        wrong = sorted(set(shapes) ^ set(expected)) or sorted(k for k in shapes if shapes[k] != expected[k])
        raise Invalid(f"{path}: its tensors do not fit the job's adapter (first differing: '{wrong[0]}')")


def _check_replay(saved: SavedCheckpoint, job: TrainingJob) -> None:
    """A GRPO generation being replayed is saved only for a job that replays (num_iterations > 1), at an
    iteration it has, its position within the generation."""
    replay, state_path = saved.state.replay, saved.folder / STATE_NAME
    if replay is None:
        return
    iterations = job.replay.iterations if job.replay is not None else 1
    if replay.iteration >= iterations:
        raise Invalid(f"{state_path}: replay is at iteration {replay.iteration}, but the job's grpo.num_iterations "
                      f"is {iterations} (another spec?)")
    if replay.position > len(replay.batches):
        raise Invalid(f"{state_path}: replay.position {replay.position} is past its {len(replay.batches)} "
                      "micro-batches")


def _check_data(state: CheckpointState, state_path: Path, job: TrainingJob) -> None:
    """Raise `DataChanged` where the checkpoint's data digest and the job's are both known and differ."""
    saved, current = state.data_digest, job.data_digest
    if saved is None or current is None or saved == current:
        return
    raise DataChanged(f"job '{job.name}': its data {job.spec.data} changed since its checkpoint at step "
                      f"{state.step} ({state_path}): {describe_change(saved, current)}; resuming would train one "
                      "adapter on two datasets. Put back the data it trained on, or start the job over "
                      "(`aspen run --overwrite`; a service's job: submit it again)")


def _check_steps(saved: SavedCheckpoint) -> None:
    """The step numbers of state.json, its history, its evals and the optimizer state agree."""
    state_path = saved.folder / STATE_NAME
    step, step_count = saved.state.step, saved.optimizer["step_count"]
    for key, values in (("evals", saved.state.evals), ("scores", saved.state.scores)):
        for i, (eval_step, value) in enumerate(values):
            if eval_step > step:
                raise Invalid(f"{state_path}: {key} entry {i} is [{eval_step}, {value!r}], not [step <= {step}, "
                              "value]")
    if step != step_count:
        raise Invalid(f"{state_path}: step {step} but the optimizer state is at step {step_count} "
                      "(files of different checkpoints)")
    history = saved.state.history
    if history and history[-1].step != step:
        raise Invalid(f"{state_path}: step {step} but the last history record is of step {history[-1].step}")


def _check_adapter(saved: SavedCheckpoint, job: TrainingJob) -> None:
    """The saved adapter (and its reference adapter, where the job holds one) has the job adapter's tensors,
    each of its shape."""
    keys = adapter_state_dict_shapes(job.adapter)   # DoRA's magnitudes, PiSSA / OLoRA's A0 and B0 included
    _check_tensors(saved.adapter, keys, saved.folder / WEIGHTS_NAME)
    if saved.reference is not None and job.spec.reference_adapter:   # the same shape: dropout 0 its only change
        _check_tensors(saved.reference, keys, saved.folder / REFERENCE_NAME)


def _check_tensors(tensors: dict[str, torch.Tensor], keys: dict[str, tuple[int, ...]], path: Path) -> None:
    missing = [key for key in keys if key not in tensors]
    extra = [key for key in tensors if key not in keys]
    if missing or extra:
        raise Invalid(f"{path}: saved with other target modules or another adapter kind ({len(missing)} "
                      f"tensors missing, {len(extra)} unexpected, e.g. {(missing + extra)[0]})")
    for key, shape in keys.items():
        if tuple(tensors[key].shape) != shape:
            raise Invalid(f"{path}: '{key}' has shape {tuple(tensors[key].shape)}, the adapter "
                          f"{shape} (another LoRA rank or init_lora_weights?)")


def _check_optimizer(saved: SavedCheckpoint, job: TrainingJob) -> None:
    """The optimizer's groups hold the job's parameters, one id each; its state (at the job's step) and the
    partial gradients have their parameters' shapes."""
    tensors_path = saved.tensors_path
    step_count = saved.optimizer["step_count"]
    parameters = job.adapter.parameters()
    torch_state = saved.optimizer["optimizer"]
    groups, job_groups = torch_state["param_groups"], job.optimizer.optimizer.param_groups
    if len(groups) != len(job_groups):
        raise Invalid(f"{tensors_path}: {len(groups)} optimizer parameter groups, the job has {len(job_groups)}")
    by_id: dict[int, torch.nn.Parameter] = {}
    for g, (group, job_group) in enumerate(zip(groups, job_groups, strict=True)):
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(job_group["params"]) or not all(map(_is_int, ids)):
            raise Invalid(f"{tensors_path}: optimizer group {g} holds {ids!r} parameter ids, the job's "
                          f"{len(job_group['params'])} parameters")
        missing = sorted(REQUIRED_GROUP_KEYS - set(group))
        if missing:
            raise Invalid(f"{tensors_path}: optimizer group {g} lacks {', '.join(missing)}")
        by_id.update(zip(ids, job_group["params"], strict=True))
    if len(by_id) != len(parameters):
        raise Invalid(f"{tensors_path}: the optimizer's parameter ids are not one per adapter parameter")
    state_ids = set(torch_state["state"])
    expected_ids = set(by_id) if step_count > 0 else set()
    if state_ids != expected_ids:
        raise Invalid(f"{tensors_path}: optimizer state for {len(state_ids)} parameters, expected "
                      f"{len(expected_ids)} at step {step_count}")
    steps = []
    for param_id, entries in torch_state["state"].items():
        param = by_id[param_id]
        if not isinstance(entries, dict):
            raise Invalid(f"{tensors_path}: optimizer state of parameter {param_id} is not a mapping")
        for key, value in entries.items():
            if key == "step":
                number = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if not isinstance(number, (int, float)) or isinstance(number, bool) or number > step_count:
                    raise Invalid(f"{tensors_path}: optimizer state of parameter {param_id} is at step "
                                  f"{value!r}, the job at step {step_count}")
                steps.append(number)
            elif isinstance(value, torch.Tensor) and tuple(value.shape) != tuple(param.shape):
                raise Invalid(f"{tensors_path}: optimizer '{key}' of parameter {param_id} has shape "
                              f"{tuple(value.shape)}, the parameter {tuple(param.shape)}")
    if steps and max(steps) != step_count:
        raise Invalid(f"{tensors_path}: the optimizer state is at step {max(steps):g}, the job at step "
                      f"{step_count} (files of different checkpoints)")

    if len(saved.gradients) != len(parameters):
        raise Invalid(f"{tensors_path}: {len(saved.gradients)} gradients saved for {len(parameters)} parameters")
    for i, (gradient, param) in enumerate(zip(saved.gradients, parameters, strict=True)):
        if gradient is not None and tuple(gradient.shape) != tuple(param.shape):
            raise Invalid(f"{tensors_path}: gradient {i} has shape {tuple(gradient.shape)}, the parameter "
                          f"{tuple(param.shape)}")


def _check_dropout_rng(saved: SavedCheckpoint, job: TrainingJob) -> None:
    """A dropout generator's state is saved where the job has LoRA dropout (format 2), of its shape."""
    tensors_path = saved.tensors_path
    generator = job.adapter.dropout_generator
    if saved.format == 2 and (generator is None) != (saved.dropout_rng is None):
        has = "has" if generator is not None else "has no"
        raise Invalid(f"{tensors_path}: dropout RNG state {'missing' if saved.dropout_rng is None else 'saved'}"
                      f", but the job {has} LoRA dropout (another LoRA config?)")
    if generator is not None and saved.dropout_rng is not None:
        current = generator.get_state()
        if saved.dropout_rng.dtype != torch.uint8 or saved.dropout_rng.shape != current.shape:
            raise Invalid(f"{tensors_path}: dropout RNG state of {saved.dropout_rng.dtype} "
                          f"{tuple(saved.dropout_rng.shape)}, the generator's is uint8 {tuple(current.shape)}")


def _restore(job: TrainingJob, saved: SavedCheckpoint) -> None:
    """Apply a validated checkpoint. The cursor goes first: it checks the position against its data; when
    it refuses it, the cursor is put back and this candidate is invalid, with the job untouched."""
    before = job.cursor.state_dict()
    try:
        job.cursor.load_state_dict(dict(saved.state.cursor))
    except (ValueError, KeyError, TypeError) as error:
        job.cursor.load_state_dict(before)
        raise Invalid(f"{saved.folder / STATE_NAME}: its data position does not fit this job's data "
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
    job.tokens_seen = saved.state.tokens_seen
    job.accumulator = saved.state.accumulator.restore()
    job.history = [record.restore() for record in saved.state.history]
    job.evals = [(step, loss) for step, loss in saved.state.evals]
    job.scores = [(step, score) for step, score in saved.state.scores]
    best = saved.state.best if isinstance(saved.state, CheckpointStateV2) else None
    job.best = None   # a best of another metric (keep_best changed) is not this job's best
    if best is not None and saved.best is not None and best.metric == job.spec.keep_best:
        job.best = KeptBest(best.metric, best.step, best.value, saved.best)
    if job.replay is not None:
        device = next(iter(job.adapter.parameters())).device
        job.replay = GrpoReplay.from_state(job.replay.iterations, saved.state.replay, device)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
