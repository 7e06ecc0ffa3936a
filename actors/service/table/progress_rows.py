"""The job table's progress rows: one per optimizer step of a job (loss, tokens, learning rate, gradient norm)
with the evaluation after it (eval loss, generation score), what reports and charts read back."""

from __future__ import annotations

import time
from typing import Any

from actors.service.table.table_connection import TableConnection, reads

COLUMNS = ("step", "loss", "tokens", "lr", "grad_norm", "eval_loss", "eval_score", "time")


class ProgressRows:
    """The `progress` rows of a job table."""

    def __init__(self, connection: TableConnection):
        self.connection = connection
        self.db = connection.db

    def add(self, job_id: str, row: dict[str, Any]) -> None:
        with self.connection.transaction():
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
        rows = self.db.execute(f"SELECT {', '.join(COLUMNS)} FROM progress WHERE job_id = ? ORDER BY step",
                               (job_id,))
        return [dict(zip(COLUMNS, row, strict=True)) for row in rows]
