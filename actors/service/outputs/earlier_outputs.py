"""What an earlier run left in a job's folder: the outputs aspen writes there (its adapter with `aspen.json`, its
checkpoint, `metrics.jsonl`), read without torch, so that a job no table knows to have written there (the folder
was copied or moved, its table deleted, its job forgotten) is refused before it trains over them: the service's
submissions (actors/service/scheduler/submissions.py) and `aspen run`'s plan (orchestrator/run_plan.py) say what was
found, whose it was and at which step. Other files in the folder (a README, data) are not outputs: a folder holding
only those is written to as any other. A storage URI's folder is looked into the same way: its adapter, its checkpoint
pointer (actors/storage/checkpoint_mirror.py) and metrics.jsonl, as its jobs upload them."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from actors.checkpoint.peft_names import METADATA_NAME, WEIGHTS_NAME
from actors.checkpoint.state import STATE_NAME, Invalid, previous_folder, read_state, saved_cursor, saved_step
from actors.service.outputs.job_files import CHECKPOINT_FOLDER, METRICS_NAME
from actors.storage.checkpoint_mirror import POINTER_NAME, read_pointer
from actors.storage.storage_errors import CorruptCheckpoint
from actors.storage.storage_location import StorageLocation
from actors.storage.storage_uri import is_uri

if TYPE_CHECKING:
    from actors.spec.submission_changes import BudgetRaise

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EarlierOutputs:
    """A job folder's outputs: `job`, the job id they name (aspen.json's, else the checkpoint's); `step`, the
    adapter's step (aspen.json); `last_step`, the step it trained to where its adapter is an earlier one (a keep_best
    job's: aspen.json's `last_step`); `best`, the evaluation that adapter is the best of (aspen.json's `best`:
    metric, step, value); `checkpoint_step`, the newest valid checkpoint's; `found`, what was found, in words;
    `written_at`, the newest modification time of those files (a copy made with `cp -r` has its copy's)."""

    folder: Path | str   # a storage URI's as its string
    job: str | None = None
    step: int | None = None
    checkpoint_step: int | None = None
    found: list[str] = field(default_factory=list)
    written_at: float | None = 0.0   # None where a store does not say
    last_step: int | None = None
    best: dict | None = None

    def describe(self) -> str:
        """'job 'first' at step 20: its adapter (aspen.json), a checkpoint at step 20, metrics.jsonl (20 rows); last
        written 2026-12-06 17:19'; a keep_best job's whose adapter is an earlier step's: 'job 'first', trained to
        step 20 (its adapter the best eval loss's, step 12): ...'."""
        whose = f"job '{self.job}'" if self.job else "a job"
        step = self.step if self.step is not None else self.checkpoint_step
        trained = max((s for s in (self.step, self.last_step, self.checkpoint_step) if s is not None), default=None)
        if self.step is not None and trained is not None and trained > self.step:   # its adapter is an earlier step's
            metric = self.best.get("metric") if self.best else None
            which = (f"the best {metric.replace('_', ' ')}'s, step {self.step}" if isinstance(metric, str)
                     else f"step {self.step}'s")
            at = f", trained to step {trained} (its adapter {which})"
        else:
            at = f" at step {step}" if step is not None else ""
        if self.written_at is None:
            return f"{whose}{at}: {', '.join(self.found)}"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.written_at))
        return f"{whose}{at}: {', '.join(self.found)}; last written {when}"


def _adapter_facts(metadata: dict | None) -> dict:
    """What aspen.json says of the adapter beside it: its step, and a keep_best job's last step and best evaluation
    (actors/service/trainer/job_ends.py writes them); the keys of `EarlierOutputs`, None where it does not say."""
    metadata = metadata or {}
    step, last_step, best = metadata.get("step"), metadata.get("last_step"), metadata.get("best")
    return {"step": step if isinstance(step, int) else None,
            "last_step": last_step if isinstance(last_step, int) else None,
            "best": best if isinstance(best, dict) else None}


def earlier_outputs(folder: Path | str) -> EarlierOutputs | None:
    """The outputs an aspen job left in `folder`, or None where it holds none (no folder, an empty one, one holding
    other files only). A storage URI's objects are read (StorageError where they cannot be)."""
    if is_uri(str(folder)):
        return _at_uri(str(folder))
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found: list[str] = []
    seen: list[Path] = []
    metadata = _metadata(folder / METADATA_NAME)
    if metadata is not None:
        found.append("its adapter (aspen.json)" if (folder / WEIGHTS_NAME).is_file() else "aspen.json")
        seen.append(folder / METADATA_NAME)
    elif (folder / WEIGHTS_NAME).is_file():
        found.append(f"an adapter ({WEIGHTS_NAME})")
        seen.append(folder / WEIGHTS_NAME)
    checkpoint_job, checkpoint_step = None, None
    checkpoint = folder / CHECKPOINT_FOLDER
    states = [path for path in (checkpoint / STATE_NAME, previous_folder(checkpoint) / STATE_NAME) if path.is_file()]
    for path in states:
        try:
            state = read_state(path)
        except Invalid:
            continue
        checkpoint_job, checkpoint_step = state.job, state.step
        break
    if states:
        found.append(f"a checkpoint at step {checkpoint_step}" if checkpoint_step is not None
                     else "a checkpoint (not readable)")
        seen += states
    rows = _rows(folder / METRICS_NAME)
    if rows:
        found.append(f"{METRICS_NAME} ({rows} rows)")
        seen.append(folder / METRICS_NAME)
    if not found:
        return None
    job = metadata.get("job_id") if metadata else None
    return EarlierOutputs(folder=folder, job=str(job) if job else checkpoint_job, checkpoint_step=checkpoint_step,
                          found=found, written_at=max(path.stat().st_mtime for path in seen),
                          **_adapter_facts(metadata))


def _at_uri(uri: str) -> EarlierOutputs | None:
    """`earlier_outputs` of a storage URI's folder: its adapter, the checkpoint its pointer names (the job's id from
    that upload's state.json), its metrics.jsonl."""
    location = StorageLocation(uri)
    names = set(location.list())
    found: list[str] = []
    seen: list[str] = []
    metadata = _parsed(location.read_bytes(METADATA_NAME)) if METADATA_NAME in names else None
    if metadata is not None:
        found.append("its adapter (aspen.json)" if WEIGHTS_NAME in names else "aspen.json")
        seen.append(METADATA_NAME)
    elif WEIGHTS_NAME in names:
        found.append(f"an adapter ({WEIGHTS_NAME})")
        seen.append(WEIGHTS_NAME)
    checkpoint_job, checkpoint_step = None, None
    if POINTER_NAME in names:
        seen.append(POINTER_NAME)
        try:
            pointer = read_pointer(location)
        except CorruptCheckpoint:
            found.append("a checkpoint (its pointer not readable)")
        else:
            checkpoint_step = pointer["step"]
            found.append(f"a checkpoint at step {checkpoint_step}")
            upload = f"{pointer['upload']}/{STATE_NAME}"
            state = _parsed(location.read_bytes(upload)) if location.exists(upload) else None
            job = state.get("job") if state else None
            checkpoint_job = job if isinstance(job, str) and job else None
    if METRICS_NAME in names:
        rows = sum(1 for line in location.read_bytes(METRICS_NAME).splitlines() if line.strip())
        if rows:
            found.append(f"{METRICS_NAME} ({rows} rows)")
            seen.append(METRICS_NAME)
    if not found:
        return None
    job = metadata.get("job_id") if metadata else None
    times = [when for when in (location.modified_at(name) for name in seen) if when is not None]
    return EarlierOutputs(folder=uri, job=str(job) if job else checkpoint_job, checkpoint_step=checkpoint_step,
                          found=found, written_at=max(times) if times else None, **_adapter_facts(metadata))


def _parsed(data: bytes) -> dict:
    """A JSON object's dict; {} where `data` is not one."""
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _metadata(path: Path) -> dict | None:
    """aspen.json's object; {} where it is there but not readable JSON (it is still aspen's); None where absent."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _rows(path: Path) -> int:
    """The lines of a metrics.jsonl that are not blank (0 where there is none)."""
    try:
        with path.open("rb") as lines:
            return sum(1 for line in lines if line.strip())
    except OSError:
        return 0


def missing_checkpoint(folder: Path | str, step: int | None) -> str | None:
    """Why a job its table records a checkpoint of (at `step`) cannot continue from it in `folder`: the folder is on
    this machine but holds no valid checkpoint (deleted, moved, damaged), so the job would start over from step 0.
    None where it holds one, where the table records none, or where it cannot be looked into from here (a storage
    URI; a folder not on this machine)."""
    if not step or is_uri(str(folder)) or not Path(folder).is_dir():
        return None
    checkpoint = Path(folder) / CHECKPOINT_FOLDER
    if saved_step(checkpoint) is not None:
        return None
    return f"its checkpoint at step {step} is no longer in {checkpoint} (deleted, moved or damaged)"


def raise_trains_nothing_from(raised: BudgetRaise, folder: Path | str) -> str | None:
    """Why a job whose checkpoint is in `folder` (a storage URI: the one uploaded there) would train nothing
    continued to `raised`: its data already ran to the end the raised budget gives
    (`submission_changes.raise_ends_at_once`); None where it trains on, or where its checkpoint cannot be looked
    into from here (a folder not on this machine; a store this process cannot read)."""
    from actors.spec.submission_changes import raise_ends_at_once

    if is_uri(str(folder)):
        saved = _uploaded_cursor(str(folder))
    else:
        saved = saved_cursor(Path(folder) / CHECKPOINT_FOLDER) if Path(folder).is_dir() else None
    if saved is None:
        return None
    step, cursor = saved
    if "num_examples" not in cursor and "num_rows" not in cursor and raised.after.epochs is not None:
        cursor, uncounted = _rows_counted_again(raised, step, cursor)
        if uncounted is not None:
            return uncounted
    return raise_ends_at_once(raised, step, cursor)


def _rows_counted_again(raised: BudgetRaise, step: int, cursor: dict) -> tuple[dict, str | None]:
    """A streamed job's cursor saved by an aspen that did not record its training rows (`num_rows`): with them counted
    again from its data (its rows after the eval split, `first_row`), or, where they cannot be counted here, why the
    raise cannot be judged (None where it surely trains on: a whole epoch more than the cursor has read)."""
    import math

    from actors.data.locations import open_table

    job = raised.after
    try:
        rows = open_table(job.data, job.split).count_rows() - int(cursor.get("first_row", 0))
    except Exception as error:  # noqa: BLE001 - any failure to read the data is said, with the error, to the user
        if math.ceil(job.epochs) > int(cursor.get("epoch", 0)) + 1:
            return cursor, None
        return cursor, (f"of unknown length: its checkpoint at step {step}, written by an older aspen, does not record "
                        f"how many rows its streamed data has (num_rows), and they could not be counted again from "
                        f"{job.data} ({error}), so whether epochs {job.epochs:g} trains anything more cannot be told; "
                        "make its data readable here and try again, or give epochs above "
                        f"{int(cursor.get('epoch', 0)) + 1} (aspen extend JOB --epochs N, or epochs in its jobs file)")
    log.info("a streamed job's checkpoint at step %d records no num_rows: %d training rows counted again from %s",
             step, rows, job.data)
    return {**cursor, "num_rows": rows}, None


def _uploaded_cursor(uri: str) -> tuple[int, dict] | None:
    """The step and data cursor's state of the checkpoint uploaded to `uri` (its pointer's upload); None without
    one, or where the store cannot be read from here (a scheduler's node may lack the credentials its trainers
    have: the trainer plans the job's steps from the checkpoint as it starts)."""
    try:
        location = StorageLocation(uri)
        pointer = read_pointer(location)
        if pointer is None:
            return None
        state = json.loads(location.read_bytes(f"{pointer['upload']}/{STATE_NAME}"))
    except (OSError, ValueError, KeyError, TypeError) as error:   # StorageError is an OSError
        log.debug("the checkpoint uploaded to %s was not read (%s): its raise is planned by its trainer", uri, error)
        return None
    cursor = state.get("cursor") if isinstance(state, dict) else None
    return (int(pointer["step"]), cursor) if isinstance(cursor, dict) else None
