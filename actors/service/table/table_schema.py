"""The job table's SQLite schema (jobs, their progress rows, their state transitions, the usage of deleted jobs
per user: user "" for operators'), the columns added
since the first release and how an older file gains them, and the error for a file locked by another process."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

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
    eval_score REAL,
    reward REAL,
    reward_margin REAL,
    best TEXT,
    tokens_per_s REAL,
    checkpoint_step INTEGER,
    adapter_dir TEXT,
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    updated_at REAL NOT NULL,
    user TEXT,
    account_tokens INTEGER NOT NULL DEFAULT 0,
    step_seconds REAL NOT NULL DEFAULT 0,
    gpu_seconds REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS progress (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL, tokens INTEGER, lr REAL, grad_norm REAL,
    eval_loss REAL, eval_score REAL, metrics TEXT, time REAL NOT NULL, PRIMARY KEY (job_id, step));
CREATE TABLE IF NOT EXISTS transitions (
    job_id TEXT NOT NULL, time REAL NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage_deleted (
    user TEXT PRIMARY KEY NOT NULL, tokens INTEGER NOT NULL DEFAULT 0, step_seconds REAL NOT NULL DEFAULT 0,
    gpu_seconds REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE INDEX IF NOT EXISTS jobs_by_name ON jobs (name);
CREATE INDEX IF NOT EXISTS jobs_by_output_dir ON jobs (output_dir);
CREATE INDEX IF NOT EXISTS jobs_by_submitted_at ON jobs (submitted_at, id);
CREATE INDEX IF NOT EXISTS transitions_by_job ON transitions (job_id);
"""

# (table, column, type) added after the first release: an older table gains them when it opens
ADDED_COLUMNS = (("progress", "eval_score", "REAL"), ("jobs", "user", "TEXT"),
                 ("jobs", "account_tokens", "INTEGER NOT NULL DEFAULT 0"),
                 ("jobs", "step_seconds", "REAL NOT NULL DEFAULT 0"),
                 ("jobs", "gpu_seconds", "REAL NOT NULL DEFAULT 0"), ("jobs", "eval_score", "REAL"),
                 ("progress", "metrics", "TEXT"), ("jobs", "reward", "REAL"), ("jobs", "reward_margin", "REAL"),
                 ("jobs", "best", "TEXT"))

NAN_TEXT = "NaN"   # how a REAL column keeps a NaN: SQLite stores a float NaN as NULL (inf and -inf it keeps)


def stored(value: Any) -> Any:
    """`value` as a REAL column keeps it: a NaN (a diverged job's loss) as the text NAN_TEXT, not as NULL, which
    would read back as 'not measured'."""
    return NAN_TEXT if isinstance(value, float) and math.isnan(value) else value


def read_back(value: Any) -> Any:
    """A REAL column's value as `stored` was given it: NAN_TEXT a float NaN again."""
    return math.nan if value == NAN_TEXT else value


BUSY_TIMEOUT_S = 2.0   # how long one write waits for another process's lock before raising JobTableBusy


class JobTableBusy(RuntimeError):
    """The job table's file is locked by another process (or its disk refuses writes); nothing was changed.
    Its message says which and what to do (`why_refused`)."""


def is_busy(error: sqlite3.OperationalError) -> bool:
    """Whether SQLite's error means the file is locked or its disk refuses writes (a retry may succeed)."""
    text = str(error).lower()
    return any(word in text for word in ("locked", "busy", "disk is full", "disk i/o error", "readonly"))


def why_refused(error: sqlite3.OperationalError, path: Path) -> str:
    """What the operator can do about a write the table's file refused (`is_busy`): its disk is full, it or
    its folder is read-only, the disk failed, or another process holds its lock."""
    text = str(error).lower()
    if "disk is full" in text:
        return f"the disk of {path.parent} is full: free space there"
    if "readonly" in text:
        return f"{path} or its folder {path.parent} is read-only: make both writable (a read-only mount?)"
    if "disk i/o error" in text:
        return f"the disk of {path.parent} failed a read or write: check it (dmesg) and its free space"
    return "another process holds it: a backup, an open sqlite3 shell, a slow disk?"


def add_missing_columns(db: sqlite3.Connection) -> None:
    """A table written by an older aspen gains the columns added since (empty for its rows)."""
    for table, column, kind in ADDED_COLUMNS:
        present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
