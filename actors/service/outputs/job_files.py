"""A job's own writer on its trainer: its `metrics.jsonl` rows (one per optimizer step, with the step's eval
loss where the job was evaluated after it: `metrics_rows`), its `generations.jsonl` (each eval_generate
evaluation's rows: prompt, reference, the adapter's continuation and its score), and the bookkeeping of I/O
failures in its output folder (metrics, generations, checkpoints, the adapter), so that a full disk or a folder
it may not write to fails that one job, after a bounded number of tries, with one clear reason, and never costs
another job a row. Rows that could not be written are kept and written with the next ones once the folder takes
writes again."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from actors.checkpoint.peft_names import CONFIG_NAME, METADATA_NAME, WEIGHTS_NAME
from actors.checkpoint.state import OPTIMIZER_NAME
from actors.storage.checkpoint_mirror import POINTER_NAME, UPLOADS_FOLDER
from actors.storage.durable import append_whole, write_durably
from actors.storage.storage_location import WRITE_PROBE, StorageLocation
from actors.storage.storage_uri import is_uri

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
GENERATIONS_NAME = "generations.jsonl"   # each eval_generate evaluation's rows: what the adapter wrote, its score
CHECKPOINT_FOLDER = "checkpoint"   # the job's newest checkpoint (actors/checkpoint.py), in its folder
REFERENCE_FOLDER = "reference"     # its frozen reference adapter, a PEFT folder (JobSpec.reference_adapter)
TENSORBOARD_FOLDER = "tb"          # its TensorBoard events (tracking: {tensorboard: true})
# what aspen writes in a job's folder (`aspen_output`): its adapter, metrics, generations, checkpoint, reference
# adapter, TensorBoard events and, for a Tinker model, its state (actors/checkpoint/interactive_state.py); a local
# MLflow store (`mlruns`) keeps every run's history, so it is not cleared
JOB_OUTPUT_NAMES = frozenset({METADATA_NAME, WEIGHTS_NAME, CONFIG_NAME, METRICS_NAME, GENERATIONS_NAME,
                              CHECKPOINT_FOLDER, REFERENCE_FOLDER, TENSORBOARD_FOLDER, "interactive_state.json",
                              OPTIMIZER_NAME})
# and in a storage URI's folder: the checkpoint pointer and its uploads (actors/storage/checkpoint_mirror.py)
URI_OUTPUT_NAMES = JOB_OUTPUT_NAMES | {POINTER_NAME, UPLOADS_FOLDER}
IO_ATTEMPTS = 3   # consecutive failed writes in a job's folder before the job fails


def unwritable_folder(folder: Path, shown: str | Path, error: OSError) -> OSError:
    """The error a job that cannot start fails with where its files cannot be written in `folder` (`shown`: the job's
    output_dir as the user gave it): a file where that folder, or one above it, goes is said as that, with its path
    and what to do (making the folder writable does not help there); else the error, and free space or make it
    writable."""
    in_the_way = next((part for part in (folder, *folder.parents) if part.exists() and not part.is_dir()), None)
    if in_the_way is not None:
        return OSError(f"cannot make its folder {folder}: a file is in the way ({in_the_way} is a file, not a folder); "
                       "move or delete that file (or give the job another output_dir), then resume the job")
    return OSError(f"cannot write its files in {shown}: {error}; make the folder writable (or free space there) and "
                   "resume the job")


class JobFiles:
    def __init__(self, job_id: str, folder: Path, attempts: int = IO_ATTEMPTS):
        self.job_id = job_id
        self.folder = Path(folder)
        self.attempts = attempts
        self.failures: dict[str, int] = {}   # what was written -> its consecutive failed writes
        self.last_error: OSError | None = None
        self.unwritten: dict[str, list[str]] = {METRICS_NAME: [], GENERATIONS_NAME: []}   # lines not yet written
        self.fds: dict[str, int] = {}

    @property
    def failed(self) -> str | None:
        """Why the job must fail (writes of one kind, its metrics or its checkpoint, failed `attempts` times
        in a row), or None. Counted per kind, so that metric rows that still fit do not hide checkpoints
        that never do."""
        worst = max(self.failures.values(), default=0)
        if worst < self.attempts or self.last_error is None:
            return None
        return (f"cannot write its files in {self.folder}: {self.last_error} ({worst} attempts in a row); "
                "free space there or make it writable, then resume the job (`aspen resume`): it continues from its "
                "last checkpoint")

    def start(self, history: list[dict[str, Any]], step: int = 0) -> None:
        """Create the folder and write metrics.jsonl afresh from the job's history (a resumed job's rows up
        to its checkpoint); generations.jsonl keeps its rows up to `step` (the step the job starts from: those
        after it are trained again). Raises OSError: a job whose folder cannot be written at all does not start."""
        self.folder.mkdir(parents=True, exist_ok=True)
        _keep_generations_through(self.folder / GENERATIONS_NAME, step)
        self.fds[METRICS_NAME] = os.open(self.folder / METRICS_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.unwritten[METRICS_NAME] = [json.dumps(row) + "\n" for row in history]
        self._flush(METRICS_NAME)
        if self.failures.get(METRICS_NAME):
            assert self.last_error is not None
            raise self.last_error

    def rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace metrics.jsonl with `rows` (e.g. a job's whole history once a final evaluation adds its loss
        to a row already written): written beside it, then renamed over it, so that a failure leaves the file
        as it was. Raises OSError."""
        path = self.folder / METRICS_NAME
        write_durably(path, "".join(json.dumps(row) + "\n" for row in rows))
        if METRICS_NAME in self.fds:
            os.close(self.fds.pop(METRICS_NAME))
        self.fds[METRICS_NAME] = os.open(path, os.O_WRONLY)
        self.unwritten[METRICS_NAME] = []

    def append(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row."""
        self.unwritten[METRICS_NAME].append(json.dumps(row) + "\n")
        self._flush(METRICS_NAME)

    def append_generations(self, step: int, samples: list[dict[str, Any]]) -> None:
        """An eval_generate evaluation's rows after `step`: a generations.jsonl line each (step, row, prompt,
        reference, prediction, score). A failed write is counted as the metrics' are."""
        self.unwritten[GENERATIONS_NAME] += _generation_lines(step, samples)
        if GENERATIONS_NAME not in self.fds:
            try:
                self.fds[GENERATIONS_NAME] = os.open(self.folder / GENERATIONS_NAME,
                                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as error:   # the lines stay to be written with the next evaluation's
                self.failed_write(error, GENERATIONS_NAME)
                return
        self._flush(GENERATIONS_NAME)

    def _flush(self, name: str) -> None:
        """Write the lines of `name` not written yet, whole: a write that fails part-way is cut back to the last
        whole line, and the lines stay to be written next time."""
        lines = self.unwritten[name]
        if not lines or name not in self.fds:
            return
        try:
            append_whole(self.fds[name], "".join(lines).encode())
        except OSError as error:
            self.failed_write(error, name)
            return
        lines.clear()
        self.succeeded(name)

    def failed_write(self, error: OSError, what: str) -> None:
        """A write of `what` in the job's folder failed (counted; one log line, no traceback)."""
        self.failures[what] = self.failures.get(what, 0) + 1
        self.last_error = error
        log.warning("job %s: writing %s in %s failed (%d of %d attempts): %s", self.job_id, what, self.folder,
                    self.failures[what], self.attempts, error)

    def succeeded(self, what: str) -> None:
        self.failures.pop(what, None)
        if not self.failures:
            self.last_error = None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _keep_generations_through(path: Path, step: int) -> None:
    """Cut generations.jsonl back to the evaluations after steps up to `step` (a line that is not whole JSON, left
    by a crash, goes too)."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    if len(kept) < len(lines):
        write_durably(path, "".join(kept))


def read_generations(output_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """A job's generations.jsonl as {steps: every evaluated step, step: the one asked for (default the last;
    None where there is none), rows: that evaluation's rows}. A folder or a storage URI (uploaded with each
    checkpoint and at the job's end); no file yet: no steps. A line that is not whole JSON (a crash's) is left
    out. Raises ValueError for a step that was not evaluated, StorageError where the storage does not answer."""
    if is_uri(output_dir):
        location = StorageLocation(str(output_dir))
        text = location.read_bytes(GENERATIONS_NAME).decode() if location.exists(GENERATIONS_NAME) else ""
    else:
        path = Path(output_dir) / GENERATIONS_NAME
        text = path.read_text(errors="replace") if path.is_file() else ""
    rows: dict[int, list[dict[str, Any]]] = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.setdefault(row["step"], []).append(row)
    steps = sorted(rows)
    if step is not None and step not in rows:
        raise ValueError(f"no generations after step {step}: the job's evaluations with eval_generate were after "
                         f"steps {steps or 'none yet'}")
    shown = step if step is not None else (steps[-1] if steps else None)
    return {"steps": steps, "step": shown, "rows": rows.get(shown, []) if shown is not None else []}


def job_generations(record: Any, step: int | None = None) -> dict[str, Any]:
    """`read_generations` of a job's record (a `JobRecord`), with its `best` (a keep_best job's best evaluation so
    far, whose step's adapter it keeps; None without one): a job that has started and whose folder is not on this
    machine (its trainer's node wrote it there, and this one does not share it) is a FileNotFoundError saying so,
    not an empty answer; a job that ended without a step or a checkpoint (its data unreadable at its start, or
    cancelled then) wrote no folder anywhere: it has none, as a job not started."""
    folder = record.output_dir
    wrote_nothing = record.finished_at is not None and not record.step and record.checkpoint_step is None
    if record.started_at is not None and not wrote_nothing and not is_uri(folder) and not Path(folder).is_dir():
        raise FileNotFoundError(f"job '{record.name}': its folder {folder} is not on this machine (the node of its "
                                "trainer wrote it there): read it on that node, or give the service an output root "
                                "every node shares (a mount or a storage URI)")
    return {**read_generations(folder, step), "best": record.best}


def _generation_lines(step: int, samples: list[dict[str, Any]]) -> list[str]:
    return [json.dumps({"step": step, "row": number, **sample}) + "\n" for number, sample in enumerate(samples)]


def metrics_rows(steps: list[dict[str, Any]], evals: list[tuple[int, float]],
                 scores: list[tuple[int, float]] = ()) -> list[dict[str, Any]]:
    """A job's metrics.jsonl rows: its optimizer steps' rows, each with `eval_loss` (and `eval_score`, its
    eval_generate metric) where the job was evaluated after that step (an evaluation at a step without a row,
    before the first step, gets a row of its own). What `aspen report` reads for the eval losses of a run in
    any mode."""
    rows = {row["step"]: dict(row) for row in steps}
    for column, values in (("eval_loss", evals), ("eval_score", scores)):
        for step, value in values:
            rows.setdefault(step, {"step": step})[column] = value
    return sorted(rows.values(), key=lambda row: row["step"])


def aspen_output(name: str, *, uri: bool = False) -> bool:
    """Whether a job folder's entry `name` is one aspen writes there: its adapter (PEFT's two files, aspen.json), its
    metrics and generations, its checkpoint and reference folders, its TensorBoard events, a Tinker model's state, and
    their staging, previous and temporary copies (`.checkpoint.previous`, `checkpoint.partial-*`, `.upload-*`,
    `.<name>.<hex>.tmp`); in a storage URI's folder (`uri`) also the checkpoint pointer, its uploads and the write
    check's probe (`.aspen-write-check-*`)."""
    if name in (URI_OUTPUT_NAMES if uri else JOB_OUTPUT_NAMES):
        return True
    if name.startswith((f"{CHECKPOINT_FOLDER}.partial-", ".upload-")) or (uri and name.startswith(WRITE_PROBE)):
        return True
    return name.startswith(".") and any(name[1:].startswith(f"{output}.") for output in JOB_OUTPUT_NAMES)


def clear_job_folder(folder: Path | str) -> None:
    """Delete what an earlier run left in a job's folder (checkpoints, adapter, metrics: `aspen_output`), keeping
    the folder itself (it may be a mount point) and whatever else is in it (a user's own files: notes, data), which
    is logged. A storage URI's folder likewise: only aspen's objects under it are deleted (StorageError when they
    cannot be)."""
    if is_uri(folder):
        location = StorageLocation(str(folder))
        names = location.list()
        for name in names:
            if aspen_output(name, uri=True):
                location.delete(name)
        kept = [name for name in names if not aspen_output(name, uri=True)]
    else:
        folder = Path(folder)
        if not folder.is_dir():
            return
        kept = []
        for path in folder.iterdir():
            if not aspen_output(path.name):
                kept.append(path.name)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    if kept:
        log.info("%s: kept %d entries aspen does not write there (%s)", folder, len(kept), ", ".join(sorted(kept)[:5]))
