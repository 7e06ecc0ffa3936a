"""The service's job table, persisted in SQLite in its state folder: every job with its state, reason
and timestamps, its progress (one row per optimizer step and evaluation), and its state transitions.
After a restart the scheduler reads it back: nothing submitted is lost.

Writes go through `transaction()`: one SQLite transaction (nested calls join the outer one), and the
change listeners hear about a state change only once it is committed. When another process holds the
file's write lock (a backup, an open `sqlite3` shell, a slow network disk) longer than `busy_timeout`, a
write raises `JobTableBusy` and leaves the table as it was, so that the caller can retry the whole
transaction later without applying anything twice.

A damaged file (overwritten, cut short, a bad disk) is found when the table opens (`PRAGMA quick_check`)
or when a read or write meets it, and raised as `JobTableDamaged`: one line naming the file, its backup
beside it and the commands that restore it (`actors/service/table/table_backup.py`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from actors.service.table.job_record import (
    ACTIVE_STATES,
    JOB_STATES,
    RECORD_COLUMNS,
    TERMINAL_STATES,
    JobRecord,
    JobState,
    record_of,
)
from actors.service.table.table_backup import JobTableDamaged, backup_path, check_result, damaged_message, is_damage
from actors.service.table.table_schema import BUSY_TIMEOUT_S, SCHEMA, JobTableBusy, add_missing_columns, is_busy
from actors.spec.job_submission import JobSubmission

__all__ = ["ACTIVE_STATES", "JOB_STATES", "RECORD_COLUMNS", "TERMINAL_STATES", "JobRecord", "JobState", "JobTable",
           "JobTableBusy", "JobTableDamaged", "record_of"]

log = logging.getLogger(__name__)


Method = TypeVar("Method", bound=Callable[..., Any])


def _reads(method: Method) -> Method:
    """A read of the table: a damaged file raises `JobTableDamaged` (one line: the file and the fix)."""

    @functools.wraps(method)
    def read(self: JobTable, *args: Any, **kwargs: Any) -> Any:
        with self._damage_as_error():
            return method(self, *args, **kwargs)

    return read  # type: ignore[return-value]


class JobTable:
    def __init__(self, path: str | Path, on_change: Callable[[JobRecord, str | None], None] | None = None,
                 busy_timeout: float = BUSY_TIMEOUT_S):
        """`on_change(record, previous_state)` is called after every committed state change (previous None
        for a new job), e.g. to publish it; it must not raise."""
        self.path = Path(path)
        self.on_change = on_change
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size == 0 and backup_path(self.path).is_file():
            # SQLite takes an empty file for a new table: every job would be forgotten without a word
            raise JobTableDamaged(damaged_message(self.path, "the file is empty, and a backup of it exists"))
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=busy_timeout)
        self.db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        self._guard = threading.RLock()      # one transaction at a time on this connection
        self._depth = 0
        self._after_commit: list[Callable[[], None]] = []
        try:
            with self._busy_as_error("open the job table"), self._damage_as_error():
                problem = check_result(self.db)   # a cut or overwritten file is found here, not mid-run
                if problem:
                    raise JobTableDamaged(damaged_message(self.path, problem))
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.executescript(SCHEMA)
                add_missing_columns(self.db)
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    # -- transactions ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One SQLite transaction for everything inside (nested calls join it). Raises `JobTableBusy`,
        with nothing written, when the file stays locked by another process."""
        with self._guard:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            with self._busy_as_error("write to the job table"), self._damage_as_error():
                self.db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                with self._damage_as_error():
                    yield
                    with self._busy_as_error("commit to the job table"):
                        self.db.execute("COMMIT")
            except BaseException:
                self._depth = 0
                self._after_commit.clear()
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
            self._depth = 0
            hooks, self._after_commit = self._after_commit, []
        for hook in hooks:
            hook()

    def after_commit(self, hook: Callable[[], None]) -> None:
        """Run `hook` once the current transaction commits (at once outside a transaction); dropped if it
        rolls back."""
        if self._depth:
            self._after_commit.append(hook)
        else:
            hook()

    @contextlib.contextmanager
    def _busy_as_error(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as error:
            if not is_busy(error):
                raise
            raise JobTableBusy(f"cannot {what} {self.path}: {error} (another process holds it: a backup, an open "
                               f"sqlite3 shell, a slow disk?); nothing was changed, and the service retries "
                               f"what it must write") from error

    @contextlib.contextmanager
    def _damage_as_error(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as error:
            if not is_damage(error):
                raise
            raise JobTableDamaged(damaged_message(self.path, error)) from error

    def _notify(self, record: JobRecord, previous: str | None) -> None:
        if self.on_change is not None:
            on_change = self.on_change
            self.after_commit(lambda: on_change(record, previous))

    # -- jobs -------------------------------------------------------------------------------------------
    def add(self, job_id: str, submission: JobSubmission, output_dir: Path) -> JobRecord:
        now = time.time()
        with self.transaction():
            self.db.execute(
                "INSERT INTO jobs (id, name, submission, base_model, quantization, priority, output_dir, state, "
                "reason, submitted_at, updated_at, user) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', 'submitted', ?, ?, ?)",
                (job_id, submission.job.name, submission.model_dump_json(), submission.base_model,
                 submission.quantization, submission.job.priority, str(output_dir), now, now, submission.user))
            self.db.execute("INSERT INTO transitions VALUES (?, ?, 'queued', 'submitted')", (job_id, now))
            record = self.get(job_id)
            self._notify(record, None)
        return record

    def delete(self, job_id: str) -> None:
        """Forget a job: its row, progress and history (e.g. a run started over with --overwrite)."""
        with self.transaction():
            for table in ("progress", "transitions"):
                self.db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    @_reads
    def get(self, job_id: str) -> JobRecord:
        row = self.db.execute(f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return record_of(row)

    @_reads
    def find(self, key: str) -> JobRecord:
        """A job by id, or by name when exactly one job has that name (the newest one is not guessed)."""
        try:
            return self.get(key)
        except KeyError:
            ids = [r[0] for r in self.db.execute("SELECT id FROM jobs WHERE name = ?", (key,))]
            if len(ids) == 1:
                return self.get(ids[0])
            if ids:
                raise KeyError(f"{len(ids)} jobs are named '{key}' ({', '.join(ids)}); give the job id") from None
            raise KeyError(f"no job with id or name '{key}'") from None

    @_reads
    def submission(self, job_id: str) -> JobSubmission:
        (text,) = self.db.execute("SELECT submission FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobSubmission.model_validate_json(text)

    @_reads
    def all(self, states: tuple[str, ...] | None = None) -> list[JobRecord]:
        query = f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs"
        args: tuple = ()
        if states:
            query += f" WHERE state IN ({', '.join('?' * len(states))})"
            args = tuple(states)
        return [record_of(row) for row in self.db.execute(query + " ORDER BY submitted_at, id", args)]

    @_reads
    def counts(self) -> dict[str, int]:
        """Jobs per state (every state present, 0 where none)."""
        counts = dict.fromkeys(JOB_STATES, 0)
        counts.update(self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"))
        return counts

    @_reads
    def writing_to(self, output_dir: Path | str, states: tuple[str, ...]) -> JobRecord | None:
        """A job in one of `states` whose output folder is `output_dir`, if any."""
        row = self.db.execute(f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs WHERE output_dir = ? AND state IN "
                              f"({', '.join('?' * len(states))}) LIMIT 1", (str(output_dir), *states)).fetchone()
        return record_of(row) if row else None

    def set_state(self, job_id: str, state: str, reason: str, **columns: Any) -> JobRecord:
        if state not in JOB_STATES:
            raise ValueError(f"unknown job state '{state}'")
        now = time.time()
        with self.transaction():
            current = self.get(job_id)
            values = {"state": state, "reason": reason, "updated_at": now, **columns}
            if state == "running" and current.started_at is None:
                values["started_at"] = now
            if state in TERMINAL_STATES:
                values["finished_at"] = now
            self._update(job_id, values)
            if current.state != state:
                self.db.execute("INSERT INTO transitions VALUES (?, ?, ?, ?)", (job_id, now, state, reason))
            elif current.reason != reason:
                self._amend_last_transition(job_id, state, reason)
            record = self.get(job_id)
            if current.state != state:
                self._notify(record, current.state)
        return record

    THEN = "; then "

    def _amend_last_transition(self, job_id: str, state: str, reason: str) -> None:
        """One history row per change of state: a new reason within the same state (starting on a trainer, then
        training there, resumed from a step) amends the row that entered the state, which keeps the reason it
        entered with and the latest one ("starting on trainer-0; then training on trainer-0, resumed from step
        40"), instead of a second row of the same state that a reader could not take at its word."""
        row = self.db.execute("SELECT rowid, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid DESC "
                              "LIMIT 1", (job_id,)).fetchone()
        if row is None or row[1] != state:
            return
        first = row[2].split(self.THEN, 1)[0]
        self.db.execute("UPDATE transitions SET reason = ? WHERE rowid = ?", (f"{first}{self.THEN}{reason}", row[0]))

    def set_reason(self, job_id: str, reason: str) -> None:
        """Say why a queued job waits (not a transition: no history row)."""
        with self.transaction():
            self.db.execute("UPDATE jobs SET reason = ? WHERE id = ? AND reason != ?", (reason, job_id, reason))

    def update(self, job_id: str, **columns: Any) -> None:
        with self.transaction():
            self._update(job_id, {"updated_at": time.time(), **columns})

    def _update(self, job_id: str, values: dict[str, Any]) -> None:
        unknown = set(values) - set(RECORD_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job columns {sorted(unknown)}")
        assignments = ", ".join(f"{key} = ?" for key in values)
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values.values(), job_id))

    @_reads
    def transitions(self, job_id: str) -> list[tuple[float, str, str]]:
        return list(self.db.execute("SELECT time, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid",
                                    (job_id,)))

    @_reads
    def transitions_after(self, after: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Every job's transitions entered after the one numbered `after` (0: from the first), oldest first, at
        most `limit`: each with its number (`seq`, increasing), the job's id and name, time, state and reason.
        What a follower of the whole table polls (the HTTP API's event stream), without gaps."""
        rows = self.db.execute("SELECT t.rowid, t.job_id, j.name, t.time, t.state, t.reason FROM transitions t "
                               "LEFT JOIN jobs j ON j.id = t.job_id WHERE t.rowid > ? ORDER BY t.rowid LIMIT ?",
                               (after, limit))
        return [dict(zip(("seq", "job", "name", "time", "state", "reason"), row, strict=True)) for row in rows]

    @_reads
    def last_transition(self) -> int:
        """The number (`seq`) of the newest transition, 0 when there is none."""
        return self.db.execute("SELECT COALESCE(MAX(rowid), 0) FROM transitions").fetchone()[0]

    # -- progress ---------------------------------------------------------------------------------------
    def add_progress(self, job_id: str, row: dict[str, Any]) -> None:
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO progress (job_id, step, loss, tokens, lr, grad_norm, time) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (job_id, row["step"], row.get("loss"), row.get("tokens"), row.get("lr"),
                             row.get("grad_norm"), time.time()))

    def add_eval(self, job_id: str, step: int, eval_loss: float | None, eval_score: float | None = None) -> None:
        """An evaluation after `step`: its loss and (eval_generate) its score; a None leaves that column be."""
        values = {name: value for name, value in (("eval_loss", eval_loss), ("eval_score", eval_score))
                  if value is not None}
        if not values:
            return
        with self.transaction():
            assignments = ", ".join(f"{name} = ?" for name in values)
            cursor = self.db.execute(f"UPDATE progress SET {assignments} WHERE job_id = ? AND step = ?",
                                     (*values.values(), job_id, step))
            if cursor.rowcount == 0:
                self.db.execute(f"INSERT INTO progress (job_id, step, {', '.join(values)}, time) "
                                f"VALUES (?, ?, {', '.join('?' for _ in values)}, ?)",
                                (job_id, step, *values.values(), time.time()))

    def add_usage(self, job_id: str, tokens: int, step_seconds: float, gpu_seconds: float) -> None:
        """A fused step's share of a job: its real tokens, its share of the step's time by those tokens, and
        that time the GPUs the step ran on."""
        with self.transaction():
            self.db.execute("UPDATE jobs SET account_tokens = account_tokens + ?, step_seconds = step_seconds + ?, "
                            "gpu_seconds = gpu_seconds + ? WHERE id = ?", (tokens, step_seconds, gpu_seconds, job_id))

    @_reads
    def accounts(self) -> dict[str | None, dict[str, float]]:
        """Each user's jobs and what they used (None: an operator's jobs): trained tokens, step-seconds and
        GPU-seconds, summed over every fused step their jobs took part in."""
        rows = self.db.execute("SELECT user, COUNT(*), SUM(account_tokens), SUM(step_seconds), SUM(gpu_seconds) "
                               "FROM jobs GROUP BY user")
        return {user: {"jobs": jobs, "tokens": int(tokens or 0), "step_seconds": float(seconds or 0.0),
                       "gpu_seconds": float(gpu or 0.0)} for user, jobs, tokens, seconds, gpu in rows}

    @_reads
    def tokens_by_user(self, since: float) -> dict[str | None, int]:
        """The tokens each user's jobs trained since the time `since` (None: an operator's jobs)."""
        rows = self.db.execute("SELECT jobs.user, SUM(progress.tokens) FROM progress JOIN jobs ON progress.job_id = "
                               "jobs.id WHERE progress.time >= ? AND progress.tokens IS NOT NULL GROUP BY jobs.user",
                               (since,))
        return {user: int(total or 0) for user, total in rows}

    @_reads
    def unfinished_of(self, user: str) -> dict[str, int]:
        """How many of the user's jobs are in each unfinished state."""
        rows = self.db.execute("SELECT state, COUNT(*) FROM jobs WHERE user = ? AND state IN ('queued', 'running', "
                               "'paused') GROUP BY state", (user,))
        return dict(rows)

    def forget_progress_after(self, job_id: str, step: int) -> None:
        """A job resumed from a checkpoint at `step` replays the steps after it."""
        with self.transaction():
            self.db.execute("DELETE FROM progress WHERE job_id = ? AND step > ?", (job_id, step))

    @_reads
    def progress(self, job_id: str) -> list[dict[str, Any]]:
        columns = ("step", "loss", "tokens", "lr", "grad_norm", "eval_loss", "eval_score", "time")
        rows = self.db.execute(f"SELECT {', '.join(columns)} FROM progress WHERE job_id = ? ORDER BY step",
                               (job_id,))
        return [dict(zip(columns, row, strict=True)) for row in rows]


def read_jobs(path: Path) -> list[tuple[JobRecord, JobSubmission]] | None:
    """Every job of the table at `path` with its submission, read without a service and without writing: a
    read-only connection creates, repairs and checkpoints nothing, and takes no lock a service would wait
    for. None where there is no table, or where it cannot be read so (damaged, or a killed service's
    write-ahead log that needs writing back first): the service that opens it does that, or says in its one
    line what is wrong."""
    if not path.is_file():
        return None
    try:
        db = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as error:
        log.info("%s: not read without the service (%s)", path, error)
        return None
    try:
        present = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}   # an older table lacks the added ones
        columns = [column if column in present else f"NULL AS {column}" for column in RECORD_COLUMNS]
        rows = db.execute(f"SELECT {', '.join(columns)}, submission FROM jobs").fetchall()
        return [(record_of(row[:-1]), JobSubmission.model_validate_json(row[-1])) for row in rows]
    except sqlite3.Error as error:
        log.info("%s: not read without the service (%s)", path, error)
        return None
    finally:
        db.close()
