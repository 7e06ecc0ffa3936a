"""The service's state folder (`ServiceState`, as a service holds it): one service at a time (an OS lock that
dies with its process), the job table opened with patience while another process holds it and backed up, and
the trainer events the table could not take before the service stopped, kept in a file beside it (fsynced) and
applied at the next start."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from actors.service.table.job_table import JobTable, JobTableBusy
from actors.service.table.table_backup import TableBackups
from actors.service.trainer.trainer_reports import TrainerEvent
from actors.storage.durable import append_record

log = logging.getLogger(__name__)

TABLE_OPEN_S = 120.0            # how long a starting service waits for a locked job table
UNAPPLIED_EVENTS = "unapplied-events.jsonl"   # events the table could not take before the service stopped
STATE_LOCK = "scheduler.lock"


class StateDirInUse(RuntimeError):
    """Another aspen service already runs on this state folder (`holder`: its process and host, as it wrote them)."""

    def __init__(self, message: str, holder: str = "another process"):
        super().__init__(message)
        self.holder = holder


class StateDirUnwritable(OSError):
    """The state folder takes no writes: its message names the folder, the cause and the fix."""


def lock_state_dir(state_dir: Path) -> Any:
    """An exclusive lock on the state folder for this process's life (released by the OS when it dies), so
    that two services never write one job table and one set of job folders."""
    while True:
        try:
            handle = (state_dir / STATE_LOCK).open("a+")
        except OSError as error:   # a read-only mount, a full disk, another user's folder
            raise StateDirUnwritable(f"cannot write the state folder {state_dir}: {error}. The service keeps its job "
                                     "table there: make it writable for this user (a read-only mount? a full disk?), "
                                     "or give the service another state_dir") from error
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise StateDirInUse(f"another aspen service or run is using {state_dir} ({holder}); wait for it to end "
                                "or stop it (a service: `aspen stop`), or give this one another state_dir (`aspen "
                                "run`: another output folder)", holder) from None
        if _still_there(handle, state_dir / STATE_LOCK):
            break
        handle.close()   # its holder removed the file as it let go (`release_state_dir`): lock the one there now
        state_dir.mkdir(parents=True, exist_ok=True)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    return handle


def _still_there(handle: Any, path: Path) -> bool:
    """Whether the locked file is still the one at `path` (not removed, nor replaced, as its holder let go)."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def release_state_dir(handle: Any, state_dir: Path, made: list[Path]) -> None:
    """Let go of the state folder's lock (`lock_state_dir`). Where the holder recorded nothing there (a run refused
    before it started: bad rows, a missing dataset), the lock file is removed while still held, and with it the
    folders the holder made (`made`, innermost last) that are empty then: no `.aspen` folder, nor output folder, is
    left behind by a run that never started. A process waiting on the removed file locks the new one instead."""
    try:
        if [entry.name for entry in state_dir.iterdir()] == [STATE_LOCK]:
            (state_dir / STATE_LOCK).unlink()
            for folder in reversed(made):
                folder.rmdir()
    except OSError:   # another file there, or no right to remove it: the lock file is harmless (an OS lock)
        pass
    finally:
        handle.close()


def live_holder(state_dir: Path) -> str | None:
    """The holder ("pid N on HOST", as it wrote itself) of the state folder's lock where a process of this machine
    holds it now (an `aspen run`, in process or through its service, or `aspen serve`); None where none does. The
    lock is probed only where the process the file names is alive (a pid reused since is then told apart), shared
    and let go at once: a read, never a hold."""
    path = state_dir / STATE_LOCK
    try:
        holder = path.read_text().strip()
        pid, host = holder.removeprefix("pid ").split(" on ", 1)
        os.kill(int(pid), 0)
    except PermissionError:   # alive, another user's process
        pass
    except (OSError, ValueError):   # no lock file, not a holder's line, no such process
        return None
    if host != socket.gethostname():
        return None
    with path.open("r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def open_job_table(path: Path, on_change: Any, timeout: float = TABLE_OPEN_S) -> JobTable:
    """The job table, waiting (with a log line) while another process holds its file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return JobTable(path, on_change=on_change)
        except JobTableBusy as error:
            if time.monotonic() > deadline:
                raise
            log.warning("scheduler: %s; waiting", error)
            time.sleep(2.0)


class ServiceState:
    """A service's state folder held for its life: created and locked for this process (`lock_state_dir`: the
    lock dies with it), then (`open_table`) its job table, waited for while another process holds the file, and
    the table's backups taken in a thread of their own; `close` closes both, the last backup taken."""

    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.lock = lock_state_dir(path)
        self.table: JobTable | None = None
        self.backups: TableBackups | None = None

    def open_table(self, on_change: Any) -> JobTable:
        self.table = open_job_table(self.path / "jobs.sqlite", on_change)
        self.backups = TableBackups(self.table.path).start()   # jobs.sqlite.backup
        return self.table

    def close(self) -> None:
        if self.table is not None:
            self.table.close()
        if self.backups is not None:
            self.backups.close()   # the last copy, of the table as this service leaves it


def spill_events(state_dir: Path, events: list[tuple[str, TrainerEvent]]) -> Path:
    """Append (trainer id, event) pairs to the spill file, durably; returns its path."""
    path = state_dir / UNAPPLIED_EVENTS
    append_record(path, "".join(json.dumps({"trainer": trainer_id, **asdict(event)}, default=str) + "\n"
                                for trainer_id, event in events).encode())
    return path


def read_spilled_events(state_dir: Path) -> list[tuple[str, TrainerEvent]] | None:
    """The spilled (trainer id, event) pairs in order, or None without a spill file. A line cut by a crash
    is logged and skipped; the rest still count."""
    path = state_dir / UNAPPLIED_EVENTS
    if not path.exists():
        return None
    events = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            events.append((row.pop("trainer"), TrainerEvent(**row)))
        except (ValueError, TypeError, KeyError) as error:
            log.error("scheduler: %s:%d is not a trainer event (%s); skipped", path, number, error)
    return events


def forget_spilled_events(state_dir: Path) -> None:
    """Remove the spill file once its events are in the table."""
    (state_dir / UNAPPLIED_EVENTS).unlink(missing_ok=True)
