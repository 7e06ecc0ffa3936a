"""The service's job table, persisted in SQLite in its state folder: every job with its state, reason
and timestamps (`JobTable`, here), its state transitions (`table.transitions`: transition_log.py), its
progress (`table.progress`, one row per optimizer step and evaluation: progress_rows.py) and what each user's
jobs used (`table.usage`: usage_accounts.py), over one connection (table_connection.py). After a restart the
scheduler reads it back: nothing submitted is lost.

Writes go through `transaction()`: one SQLite transaction (nested calls join the outer one), and the
change listeners hear about a state change only once it is committed. When another process holds the
file's write lock (a backup, an open `sqlite3` shell, a slow network disk) longer than `busy_timeout`, a
write raises `JobTableBusy` and leaves the table as it was, so that the caller can retry the whole
transaction later without applying anything twice.

A damaged file (overwritten, cut short, a bad disk) is found when the table opens (`PRAGMA quick_check`)
or when a read or write meets it, and raised as `JobTableDamaged`: one line naming the file, its backup
beside it and the commands that restore it (`actors/service/table/table_backup.py`)."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.data.formats import STORED
from actors.service.table.job_record import (
    ACTIVE_STATES,
    JOB_STATES,
    RECORD_COLUMNS,
    TERMINAL_STATES,
    JobRecord,
    JobState,
    column_values,
    record_of,
)
from actors.service.table.progress_rows import ProgressRows
from actors.service.table.table_backup import JobTableDamaged
from actors.service.table.table_connection import TableConnection, reads
from actors.service.table.table_schema import BUSY_TIMEOUT_S, JobTableBusy
from actors.service.table.transition_log import TransitionLog
from actors.service.table.usage_accounts import UsageAccounts
from actors.spec.job_submission import JobSubmission

__all__ = ["ACTIVE_STATES", "JOB_STATES", "RECORD_COLUMNS", "TERMINAL_STATES", "AmbiguousJobName", "JobRecord",
           "JobState", "JobTable", "JobTableBusy", "JobTableDamaged", "record_of"]

log = logging.getLogger(__name__)


class AmbiguousJobName(KeyError):
    """A name several jobs of the table have (a finished job's name may be taken again): the job is there, which one
    is not said; the HTTP API answers 409, not 404."""

    def __str__(self) -> str:   # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class JobTable:
    """Every job's row; `transitions`, `progress` and `usage` are the rest of what the table stores."""

    def __init__(self, path: str | Path, on_change: Callable[[JobRecord, str | None], None] | None = None,
                 busy_timeout: float = BUSY_TIMEOUT_S):
        """`on_change(record, previous_state)` is called after every committed state change (previous None
        for a new job), e.g. to publish it; it must not raise."""
        self.connection = TableConnection(path, busy_timeout)
        self.path = self.connection.path
        self.db = self.connection.db
        self.on_change = on_change
        self.transaction = self.connection.transaction
        self.after_commit = self.connection.after_commit
        self.transitions = TransitionLog(self.connection)
        self.progress = ProgressRows(self.connection)
        self.usage = UsageAccounts(self.connection)

    def close(self) -> None:
        self.connection.close()

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
            self.transitions.enter(job_id, now, "queued", "submitted")
            record = self.get(job_id)
            self._notify(record, None)
        return record

    def delete(self, job_id: str) -> None:
        """Forget a job: its row, progress and history (e.g. a run started over with --overwrite)."""
        with self.transaction():
            self.progress.forget(job_id)
            self.transitions.forget(job_id)
            self.usage.keep_deleted(job_id)   # its usage leaves the accounts, not the metrics' counters
            self.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    @reads
    def get(self, job_id: str) -> JobRecord:
        row = self.db.execute(f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        return record_of(row)

    @reads
    def find(self, key: str) -> JobRecord:
        """A job by id, or by name when exactly one job has that name (the newest one is not guessed)."""
        try:
            return self.get(key)
        except KeyError:
            ids = [r[0] for r in self.db.execute("SELECT id FROM jobs WHERE name = ?", (key,))]
            if len(ids) == 1:
                return self.get(ids[0])
            if ids:
                raise AmbiguousJobName(f"{len(ids)} jobs are named '{key}' ({', '.join(ids)}); give the job id") \
                    from None
            raise KeyError(f"no job with id or name '{key}'") from None

    def set_submission(self, job_id: str, submission: JobSubmission) -> None:
        """The job's submission as it now stands (a `job:<id>` init_adapter replaced by that job's adapter folder)."""
        with self.transaction():
            self._update(job_id, {"updated_at": time.time()})
            self.db.execute("UPDATE jobs SET submission = ? WHERE id = ?", (submission.model_dump_json(), job_id))

    @reads
    def submission(self, job_id: str) -> JobSubmission:
        (text,) = self.db.execute("SELECT submission FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobSubmission.model_validate_json(text, context={STORED: True})

    @reads
    def all(self, states: tuple[str, ...] | None = None, *, limit: int | None = None,
            after: tuple[float, str] | None = None, user: str | None = None) -> list[JobRecord]:
        """Every job (or those in `states`, or of `user`), oldest first (by submitted_at, then id); a page of them:
        at most `limit`, those after the job whose (submitted_at, id) is `after` (`page_cursor` of the last one)."""
        query = f"SELECT {', '.join(RECORD_COLUMNS)} FROM jobs"
        conditions, args = [], []
        if states:
            conditions.append(f"state IN ({', '.join('?' * len(states))})")
            args.extend(states)
        if user is not None:
            conditions.append("user = ?")
            args.append(user)
        if after is not None:
            conditions.append("(submitted_at > ? OR (submitted_at = ? AND id > ?))")
            args.extend((after[0], after[0], after[1]))
        if conditions:
            query += " WHERE " + " AND ".join(conditions)
        query += " ORDER BY submitted_at, id" + (" LIMIT ?" if limit is not None else "")
        return [record_of(row) for row in self.db.execute(query, (*args, *(() if limit is None else (limit,))))]

    @reads
    def counts(self) -> dict[str, int]:
        """Jobs per state (every state present, 0 where none)."""
        counts = dict.fromkeys(JOB_STATES, 0)
        counts.update(self.db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"))
        return counts

    @reads
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
                self.transitions.enter(job_id, now, state, reason)
            elif current.reason != reason:
                self.transitions.amend_last(job_id, state, reason)
            record = self.get(job_id)
            if current.state != state:
                self._notify(record, current.state)
        return record

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
        values = column_values(values)
        assignments = ", ".join(f"{key} = ?" for key in values)
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values.values(), job_id))


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
        return [(record_of(row[:-1]), JobSubmission.model_validate_json(row[-1], context={STORED: True}))
                for row in rows]
    except sqlite3.Error as error:
        log.info("%s: not read without the service (%s)", path, error)
        return None
    finally:
        db.close()
