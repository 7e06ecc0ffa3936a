"""The job table's progress rows: one per optimizer step of a job (loss, tokens, learning rate, gradient norm, and
its method's metrics: a GRPO job's rewards, a preference job's margins, as in its metrics.jsonl) with the
evaluation after it (eval loss, generation score), what reports and charts read back."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from actors.service.table.table_connection import TableConnection, reads
from actors.service.table.table_schema import read_back, stored

COLUMNS = ("step", "loss", "tokens", "lr", "grad_norm", "eval_loss", "eval_score", "time")
NUMBERS = ("loss", "lr", "grad_norm", "eval_loss", "eval_score")   # REAL columns: a NaN kept as text (stored)
REPORTED = ("tokens_per_s", "total_steps")   # what a progress report carries besides its row: not kept here


def method_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A step row's metrics beyond the columns (`reward`, `rewards/margins`, `kl`, ...): its numbers only."""
    return {name: value for name, value in row.items()
            if name not in COLUMNS and name not in REPORTED and isinstance(value, int | float)
            and not isinstance(value, bool)}


def progress_of(db: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    """A job's rows from a job table's connection (a read-only one too: a table older than the metrics column
    has none), each with its method's metrics beside the columns, as its metrics.jsonl row has them."""
    present = {row[1] for row in db.execute("PRAGMA table_info(progress)")}
    columns = [name for name in COLUMNS if name in present]
    extra = ", metrics" if "metrics" in present else ""
    rows = db.execute(f"SELECT {', '.join(columns)}{extra} FROM progress WHERE job_id = ? ORDER BY step", (job_id,))
    out = []
    for row in rows:
        values = {name: None for name in COLUMNS} | {name: read_back(value) if name in NUMBERS else value
                                                     for name, value in zip(columns, row, strict=False)}
        out.append(values | (json.loads(row[-1]) if extra and row[-1] else {}))
    return out


class ProgressRows:
    """The `progress` rows of a job table."""

    def __init__(self, connection: TableConnection):
        self.connection = connection
        self.db = connection.db

    def add(self, job_id: str, row: dict[str, Any]) -> None:
        with self.connection.transaction():
            metrics = method_metrics(row)
            self.db.execute("INSERT OR REPLACE INTO progress (job_id, step, loss, tokens, lr, grad_norm, metrics, "
                            "time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (job_id, row["step"], stored(row.get("loss")), row.get("tokens"), stored(row.get("lr")),
                             stored(row.get("grad_norm")), json.dumps(metrics) if metrics else None, time.time()))

    def add_eval(self, job_id: str, step: int, eval_loss: float | None, eval_score: float | None = None) -> None:
        """An evaluation after `step`: its loss and (eval_generate) its score; a None leaves that column be."""
        values = {name: stored(value) for name, value in (("eval_loss", eval_loss), ("eval_score", eval_score))
                  if value is not None}
        if not values:
            return
        with self.connection.transaction():
            assignments = ", ".join(f"{name} = ?" for name in values)
            cursor = self.db.execute(f"UPDATE progress SET {assignments} WHERE job_id = ? AND step = ?",
                                     (*values.values(), job_id, step))
            if cursor.rowcount == 0:
                self.db.execute(f"INSERT INTO progress (job_id, step, {', '.join(values)}, time) "
                                f"VALUES (?, ?, {', '.join('?' for _ in values)}, ?)",
                                (job_id, step, *values.values(), time.time()))

    def forget_after(self, job_id: str, step: int) -> None:
        """A job resumed from a checkpoint at `step` replays the steps after it."""
        with self.connection.transaction():
            self.db.execute("DELETE FROM progress WHERE job_id = ? AND step > ?", (job_id, step))

    def forget(self, job_id: str) -> None:
        self.db.execute("DELETE FROM progress WHERE job_id = ?", (job_id,))

    @reads
    def of_job(self, job_id: str) -> list[dict[str, Any]]:
        return progress_of(self.db, job_id)
