"""The job table's SQLite connection: opened and checked (a damaged file is found here, not mid-run), its
schema created or migrated (table_schema.py), and its transactions: one at a time on this connection, nested
calls joining the outer one, hooks run once a transaction commits. A file held by another process raises
`JobTableBusy` with nothing written; a damaged one `JobTableDamaged` naming the file and its backup."""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from actors.service.table.table_backup import JobTableDamaged, backup_path, check_result, damaged_message, is_damage
from actors.service.table.table_schema import (
    BUSY_TIMEOUT_S,
    SCHEMA,
    JobTableBusy,
    add_missing_columns,
    is_busy,
    why_refused,
)

Method = TypeVar("Method", bound=Callable[..., Any])


def reads(method: Method) -> Method:
    """A read of the table (a method of an object with `.connection`): a damaged file raises
    `JobTableDamaged` (one line: the file and the fix)."""

    @functools.wraps(method)
    def read(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.connection.damage_as_error():
            return method(self, *args, **kwargs)

    return read  # type: ignore[return-value]


class TableConnection:
    """One SQLite connection to the job table's file, and its transactions."""

    def __init__(self, path: str | Path, busy_timeout: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
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
            with self.busy_as_error("open the job table"), self.damage_as_error():
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
            with self.busy_as_error("write to the job table"), self.damage_as_error():
                self.db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                with self.damage_as_error():
                    yield
                    with self.busy_as_error("commit to the job table"):
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
    def busy_as_error(self, what: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as error:
            if not is_busy(error):
                raise
            raise JobTableBusy(f"cannot {what} {self.path}: {error} ({why_refused(error, self.path)}); nothing "
                               f"was changed, and the service retries what it must write") from error

    @contextlib.contextmanager
    def damage_as_error(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.DatabaseError as error:
            if not is_damage(error):
                raise
            raise JobTableDamaged(damaged_message(self.path, error)) from error
