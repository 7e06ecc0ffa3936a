"""The service's job table, persisted in SQLite in its state folder: every job with its state, reason
and timestamps, its progress (one row per optimizer step and evaluation), and its state transitions.
After a restart the scheduler reads it back: nothing submitted is lost."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Literal

from actors.engine.spec import JobSubmission

JobState = Literal["queued", "running", "paused", "completed", "stopped_early", "failed", "cancelled"]
JOB_STATES: tuple[str, ...] = ("queued", "running", "paused", "completed", "stopped_early", "failed", "cancelled")
TERMINAL_STATES = frozenset({"completed", "stopped_early", "failed", "cancelled"})

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    submission TEXT NOT NULL,
    base_model TEXT NOT NULL,
    quantization TEXT NOT NULL,
    priority INTEGER NOT NULL,
    output_dir TEXT NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    trainer TEXT,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER,
    tokens INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    eval_loss REAL,
    tokens_per_s REAL,
    checkpoint_step INTEGER,
    adapter_dir TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS progress (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL, tokens INTEGER, lr REAL, grad_norm REAL,
    eval_loss REAL, time REAL NOT NULL, PRIMARY KEY (job_id, step));
CREATE TABLE IF NOT EXISTS transitions (
    job_id TEXT NOT NULL, time REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL);
"""


@dataclass
class JobRecord:
    """A job as the service reports it."""

    id: str
    name: str
    state: str
    reason: str
    base_model: str
    quantization: str
    priority: int
    output_dir: str
    trainer: str | None
    step: int
    total_steps: int | None
    tokens: int
    loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    checkpoint_step: int | None
    adapter_dir: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


RECORD_COLUMNS = [f.name for f in fields(JobRecord)]


class JobTable:
    def __init__(self, path: str | Path, on_change: Callable[[JobRecord, str | None], None] | None = None):
        """`on_change(record, previous_state)` is called after every state change (previous None for a
        new job), e.g. to publish it; it must not raise."""
        self.path = Path(path)
        self.on_change = on_change
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # -- jobs -------------------------------------------------------------------------------------------
    def add(self, job_id: str, submission: JobSubmission, output_dir: Path) -> JobRecord:
        now = time.time()
        with self.db:
            self.db.execute(
                "INSERT INTO jobs (id, name, submission, base_model, quantization, priority, output_dir, state, "
                "reason, submitted_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', 'submitted', ?, ?)",
                (job_id, submission.job.name, submission.model_dump_json(), submission.base_model,
                 submission.quantization, submission.job.priority, str(output_dir), now, now))
            self.db.execute("INSERT INTO transitions VALUES (?, ?, 'queued', 'submitted')", (job_id, now))
        record = self.get(job_id)
        if self.on_change is not None:
            self.on_change(record, None)
        return record

    def get(self, job_id: str) -> JobRecord:
        row = self.db.execute(f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return JobRecord(*row)

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

    def submission(self, job_id: str) -> JobSubmission:
        (text,) = self.db.execute("SELECT submission FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobSubmission.model_validate_json(text)

    def all(self, states: tuple[str, ...] | None = None) -> list[JobRecord]:
        query = f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs"
        args: tuple = ()
        if states:
            query += f" WHERE state IN ({', '.join('?' * len(states))})"
            args = tuple(states)
        return [JobRecord(*row) for row in self.db.execute(query + " ORDER BY submitted_at, id", args)]

    def set_state(self, job_id: str, state: str, reason: str, **columns: Any) -> JobRecord:
        if state not in JOB_STATES:
            raise ValueError(f"unknown job state '{state}'")
        now = time.time()
        current = self.get(job_id)
        values = {"state": state, "reason": reason, "updated_at": now, **columns}
        if state == "running" and current.started_at is None:
            values["started_at"] = now
        if state in TERMINAL_STATES:
            values["finished_at"] = now
        with self.db:
            self._update(job_id, values)
            if current.state != state or current.reason != reason:
                self.db.execute("INSERT INTO transitions VALUES (?, ?, ?, ?)", (job_id, now, state, reason))
        record = self.get(job_id)
        if self.on_change is not None and current.state != state:
            self.on_change(record, current.state)
        return record

    def set_reason(self, job_id: str, reason: str) -> None:
        """Say why a queued job waits (not a transition: no history row)."""
        with self.db:
            self.db.execute("UPDATE jobs SET reason = ? WHERE id = ? AND reason != ?", (reason, job_id, reason))

    def update(self, job_id: str, **columns: Any) -> None:
        with self.db:
            self._update(job_id, {"updated_at": time.time(), **columns})

    def _update(self, job_id: str, values: dict[str, Any]) -> None:
        unknown = set(values) - set(RECORD_COLUMNS)
        if unknown:
            raise ValueError(f"unknown job columns {sorted(unknown)}")
        assignments = ", ".join(f"{key} = ?" for key in values)
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values.values(), job_id))

    def transitions(self, job_id: str) -> list[tuple[float, str, str]]:
        return list(self.db.execute("SELECT time, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid",
                                    (job_id,)))

    # -- progress ---------------------------------------------------------------------------------------
    def add_progress(self, job_id: str, row: dict[str, Any]) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO progress (job_id, step, loss, tokens, lr, grad_norm, time) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (job_id, row["step"], row.get("loss"), row.get("tokens"), row.get("lr"),
                             row.get("grad_norm"), time.time()))

    def add_eval(self, job_id: str, step: int, eval_loss: float) -> None:
        with self.db:
            cursor = self.db.execute("UPDATE progress SET eval_loss = ? WHERE job_id = ? AND step = ?",
                                     (eval_loss, job_id, step))
            if cursor.rowcount == 0:
                self.db.execute("INSERT INTO progress (job_id, step, eval_loss, time) VALUES (?, ?, ?, ?)",
                                (job_id, step, eval_loss, time.time()))

    def forget_progress_after(self, job_id: str, step: int) -> None:
        """A job resumed from a checkpoint at `step` replays the steps after it."""
        with self.db:
            self.db.execute("DELETE FROM progress WHERE job_id = ? AND step > ?", (job_id, step))

    def progress(self, job_id: str) -> list[dict[str, Any]]:
        columns = ("step", "loss", "tokens", "lr", "grad_norm", "eval_loss", "time")
        rows = self.db.execute(f"SELECT {', '.join(columns)} FROM progress WHERE job_id = ? ORDER BY step",
                               (job_id,))
        return [dict(zip(columns, row)) for row in rows]
