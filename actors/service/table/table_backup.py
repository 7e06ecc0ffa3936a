"""The job table's backup and its damage report. The service's whole memory is one SQLite file
(`<state_dir>/jobs.sqlite`); beside it, `jobs.sqlite.backup` is a recent consistent copy, taken with
SQLite's online backup API from a connection of its own (a snapshot of the write-ahead log: the scheduler
goes on writing meanwhile), checked (`PRAGMA quick_check`), written to a temporary file, fsynced and
renamed over the previous copy: it is either the old copy or the complete new one, and never a damaged
table (a copy that fails its check is dropped and the previous one kept). `TableBackups` takes one at the
service's start, every `BACKUP_EVERY_S` in a thread of its own, and at a clean shutdown.

A damaged table (`file is not a database`, `database disk image is malformed`) is reported in one line by
`damaged_message`: which file, what SQLite said, whether the backup is sound (when it was taken, how many
jobs it holds) and the shell commands that move the damaged files away and restore the copy, or, without a
sound copy, that start over with an empty table. Ray-free and torch-free (the HTTP client imports it)."""

from __future__ import annotations

import logging
import shlex
import sqlite3
import threading
import time
from pathlib import Path

from actors.storage.durable import write_durably

log = logging.getLogger(__name__)

BACKUP_SUFFIX = ".backup"
BACKUP_EVERY_S = 600.0      # a copy every 10 minutes while the service runs (and at its start and clean stop)
DAMAGE_CODES = (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB)


class JobTableDamaged(RuntimeError):
    """The job table's file is damaged; the message says which file and how to restore its backup."""


def _uri(path: Path, mode: str) -> str:
    return f"{Path(path).absolute().as_uri()}?mode={mode}"


def backup_path(table: Path) -> Path:
    return table.with_name(table.name + BACKUP_SUFFIX)


def is_damage(error: BaseException) -> bool:
    """Whether `error` is SQLite saying the file is not a (sound) database, as opposed to a lock, a full disk or
    a constraint."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.DatabaseError) and code is not None and code & 0xFF in DAMAGE_CODES


def check_result(db: sqlite3.Connection) -> str | None:
    """None when `PRAGMA quick_check` finds the database sound, else its first finding (one line)."""
    rows = [row[0] for row in db.execute("PRAGMA quick_check")]
    if rows == ["ok"]:
        return None
    findings = [row for row in rows if not row.startswith("***")] or rows
    return " ".join(findings[0].split())


def take_backup(table: Path) -> Path:
    """Copy the job table to its backup path, consistently while the service writes (one read transaction
    of a connection of its own), check the copy and rename it into place. Raises `JobTableDamaged` where the
    table fails the check (the previous backup is kept), `sqlite3.Error` / `OSError` where it cannot be
    read or the copy written."""
    def write(temporary: Path) -> None:
        source = sqlite3.connect(_uri(table, "rw"), uri=True, timeout=30)   # never creates a missing table
        copy = sqlite3.connect(temporary)   # an empty file: SQLite makes it a database
        try:
            source.backup(copy)                           # every page in one step: one snapshot of the table
            copy.execute("PRAGMA journal_mode=DELETE")    # one self-contained file (the table's mode is WAL)
            problem = check_result(copy)
        except sqlite3.DatabaseError as error:
            if not is_damage(error):
                raise
            problem = str(error)
        finally:
            copy.close()
            source.close()
        if problem:
            raise JobTableDamaged(damaged_message(table, problem))

    target = backup_path(table)
    write_durably(target, write)   # fsynced, renamed over the last backup, the folder fsynced
    return target


def _backup_state(backup: Path) -> tuple[str | None, str]:
    """(None, 'of <time> (<n> jobs)') for a sound backup, else (its problem, '')."""
    if not backup.is_file():
        return "there is none yet", ""
    try:
        db = sqlite3.connect(_uri(backup, "ro"), uri=True)
        try:
            problem = check_result(db)
            jobs = None if problem else db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error as error:
        problem = str(error)
    if problem:
        return f"it is damaged too ({problem})", ""
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(backup.stat().st_mtime))
    return None, f"of {taken} ({jobs} jobs)"


def damaged_message(table: Path, problem: BaseException | str) -> str:
    """One line: the damaged file, SQLite's words, and the commands that move the table's files (its
    write-ahead log, its backup: every `jobs.sqlite*`) into a folder beside it and restore the backup from
    there, or, without a sound backup, start over with an empty table."""
    table = Path(table).absolute()
    backup = backup_path(table)
    aside = table.parent / time.strftime("damaged-%Y%m%d-%H%M%S")
    q = lambda path: shlex.quote(str(path))  # noqa: E731 - a shell-quoting shorthand for the commands below
    move = f"mkdir {q(aside)} && mv {q(table)}* {q(aside)}/"
    head = f"the job table {table} is damaged ({' '.join(str(problem).split())})"
    unsound, described = _backup_state(backup)
    if unsound is None:
        return (f"{head}; to go back to its backup {described}, with no aspen service on {table.parent}, run: "
                f"{move} && cp {q(aside / backup.name)} {q(table)}  (jobs submitted or changed since then are not "
                "in it; their folders are kept)")
    return (f"{head}, and its backup {backup}: {unsound}; to start over with an empty job table (the jobs' folders "
            f"are kept), with no aspen service on {table.parent}, run: {move}")


class TableBackups:
    """The job table's backup taken at start, every `every_s` and at `close()`, in a thread of its own: the
    scheduler's loop never waits for one. A copy that fails is logged (a damaged table: as an error naming
    the file and the fix) and tried again at the next interval."""

    def __init__(self, table: Path, every_s: float = BACKUP_EVERY_S):
        self.table = Path(table)
        self.every_s = every_s
        self.stopping = threading.Event()
        self.lock = threading.Lock()       # one copy at a time (the thread's and close()'s)
        self.thread = threading.Thread(target=self._run, name="job-table-backups", daemon=True)
        self.taken = 0                     # copies written so far

    def start(self) -> TableBackups:
        for leftover in self.table.parent.glob(f".{backup_path(self.table).name}.*.tmp"):   # a crash mid-copy
            leftover.unlink(missing_ok=True)
        self.thread.start()
        return self

    def take(self) -> bool:
        """One copy now; False (logged) where it could not be taken."""
        with self.lock:
            try:
                take_backup(self.table)
            except JobTableDamaged as error:
                log.error("scheduler: %s", error)
                return False
            except (sqlite3.Error, OSError) as error:
                log.warning("scheduler: could not back up the job table %s to %s (%s); the previous copy is kept "
                            "and the next try is in %.0f s", self.table, backup_path(self.table), error, self.every_s)
                return False
            self.taken += 1
            return True

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.take()
            self.stopping.wait(self.every_s)

    def close(self) -> None:
        """Stop the thread and take the last copy (call after the table's last write)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()
        self.take()
