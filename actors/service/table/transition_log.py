"""The job table's history of state transitions: one row per change of a job's state, numbered (`seq`) so that
a follower of the whole table (the HTTP API's event stream) polls it without gaps."""

from __future__ import annotations

from typing import Any

from actors.service.table.table_connection import TableConnection, reads

THEN = "; then "


class TransitionLog:
    """The `transitions` rows of a job table."""

    def __init__(self, connection: TableConnection):
        self.connection = connection
        self.db = connection.db

    def enter(self, job_id: str, time: float, state: str, reason: str) -> None:
        """A job entered `state` (inside the caller's transaction)."""
        self.db.execute("INSERT INTO transitions VALUES (?, ?, ?, ?)", (job_id, time, state, reason))

    def amend_last(self, job_id: str, state: str, reason: str) -> None:
        """One history row per change of state: a new reason within the same state (starting on a trainer, then
        training there, resumed from a step) amends the row that entered the state, which keeps the reason it
        entered with and the latest one ("starting on trainer-0; then training on trainer-0, resumed from step
        40"), instead of a second row of the same state that a reader could not take at its word."""
        row = self.db.execute("SELECT rowid, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid DESC "
                              "LIMIT 1", (job_id,)).fetchone()
        if row is None or row[1] != state:
            return
        first = row[2].split(THEN, 1)[0]
        self.db.execute("UPDATE transitions SET reason = ? WHERE rowid = ?", (f"{first}{THEN}{reason}", row[0]))

    def forget(self, job_id: str) -> None:
        self.db.execute("DELETE FROM transitions WHERE job_id = ?", (job_id,))

    @reads
    def of_job(self, job_id: str) -> list[tuple[float, str, str]]:
        """The job's transitions, oldest first: (time, state, reason)."""
        return list(self.db.execute("SELECT time, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid",
                                    (job_id,)))

    @reads
    def after(self, after: int, limit: int = 1000) -> list[dict[str, Any]]:
        """Every job's transitions entered after the one numbered `after` (0: from the first), oldest first, at
        most `limit`: each with its number (`seq`, increasing), the job's id and name, time, state and reason.
        What a follower of the whole table polls (the HTTP API's event stream), without gaps."""
        rows = self.db.execute("SELECT t.rowid, t.job_id, j.name, t.time, t.state, t.reason FROM transitions t "
                               "LEFT JOIN jobs j ON j.id = t.job_id WHERE t.rowid > ? ORDER BY t.rowid LIMIT ?",
                               (after, limit))
        return [dict(zip(("seq", "job", "name", "time", "state", "reason"), row, strict=True)) for row in rows]

    @reads
    def last(self) -> int:
        """The number (`seq`) of the newest transition, 0 when there is none."""
        return self.db.execute("SELECT COALESCE(MAX(rowid), 0) FROM transitions").fetchone()[0]
