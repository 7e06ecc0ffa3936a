"""The service's state folder: one service per folder (an in-process run's folder held on by the thread that planned
its run, refused to any other; a read-only one refused naming it and the fix), and trainer events the job table
could not take kept across a stop, including after a crash cut the file's last line."""

from __future__ import annotations

import subprocess
import threading

import pytest

from actors.service.scheduler.local_run import held_run_folder
from actors.service.table.job_table import read_jobs
from actors.service.table.state_dir import (
    UNAPPLIED_EVENTS,
    ServiceState,
    StateDirInUse,
    StateDirUnwritable,
    forget_spilled_events,
    lock_state_dir,
    read_spilled_events,
    spill_events,
)
from actors.service.table.table_backup import backup_path
from actors.service.trainer.trainer_reports import TrainerEvent
from actors.spec.job_submission import JobSubmission
from orchestrator.client import Client
from orchestrator.errors import ServiceError
from tests.helpers.fused import job_spec
from tests.helpers.service import service_config


def test_a_second_service_on_one_state_folder_is_refused_naming_the_first(tmp_path):
    first = lock_state_dir(tmp_path)
    try:
        with pytest.raises(StateDirInUse, match=r"another aspen service or run is using .*pid \d+.*aspen stop"):
            lock_state_dir(tmp_path)
    finally:
        first.close()
    lock_state_dir(tmp_path).close()   # free again once the first let go


def test_a_service_on_a_read_only_state_folder_is_refused_naming_it_and_the_fix(ray_session, tiny_model_dirs,
                                                                               tmp_path, small_disks):
    state = small_disks(tmp_path / "state")
    subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
    with pytest.raises(StateDirUnwritable, match=rf"cannot write the state folder {state}: \[Errno 30\] "
                                                 r"Read-only file system: .*make it writable"):
        lock_state_dir(state)
    with pytest.raises(ServiceError) as refused:   # as `aspen serve` / Client.local say it
        Client.local(service_config(state, tiny_model_dirs["llama"]))
    message = str(refused.value)
    assert f"could not start: cannot write the state folder {state}" in message and "another state_dir" in message


def test_a_service_holds_its_folder_and_leaves_its_table_backed_up(tmp_path):
    """`ServiceState` as the scheduler actor holds it: the folder made and locked (a second service refused before it
    opens anything), its table opened, and on close the table closed with a last backup that holds the jobs."""
    changes = []
    state = ServiceState(tmp_path / "state")
    table = state.open_table(lambda *change: changes.append(change))
    with pytest.raises(StateDirInUse):
        ServiceState(tmp_path / "state")
    table.add("kept-1", JobSubmission(job=job_spec("kept")), tmp_path / "out" / "kept")
    assert changes, "the table's changes reach the listener it was opened with"
    state.close()
    backup = backup_path(table.path)
    assert [record.name for record, _ in read_jobs(backup)] == ["kept"]


def test_a_run_folder_is_held_on_by_its_thread_and_refused_to_others(tmp_path):
    refusals = []

    def other_thread() -> None:
        try:
            with held_run_folder(tmp_path):
                pass
        except StateDirInUse as error:
            refusals.append(str(error))

    with held_run_folder(tmp_path):
        with held_run_folder(tmp_path / "."):   # the same folder, by the thread that holds it: held on
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        with pytest.raises(StateDirInUse):   # still held after the inner block: by the outer one
            lock_state_dir(tmp_path).close()
    assert len(refusals) == 1 and "another aspen run or service is writing to" in refusals[0], refusals
    lock_state_dir(tmp_path).close()   # free once the outer block let go


def test_spilled_events_come_back_in_order_and_a_cut_line_is_skipped(tmp_path, caplog):
    events = [("trainer-0", TrainerEvent(kind="progress", job_id="job-a", step=step, data={"loss": 1.0 / step}))
              for step in (1, 2, 3)]
    assert read_spilled_events(tmp_path) is None
    spill_events(tmp_path, events[:2])
    spill_events(tmp_path, events[2:])
    with (tmp_path / UNAPPLIED_EVENTS).open("a") as handle:
        handle.write('{"trainer": "trainer-0", "kind": "progr')   # a crash mid-write
    assert read_spilled_events(tmp_path) == events
    assert f"{UNAPPLIED_EVENTS}:4 is not a trainer event" in caplog.text
    forget_spilled_events(tmp_path)
    assert read_spilled_events(tmp_path) is None


def test_a_lock_file_removed_as_its_holder_let_go_is_not_the_one_locked(tmp_path, monkeypatch):
    """A run that recorded nothing removes its lock file as it lets go (`release_state_dir`); a process that opened
    the old file just before then locks a file no one else sees, and a third would run beside it. The lock is taken
    on the file there now: the OS's own lock (a real `flock` from another process) refuses it."""
    import fcntl
    import os
    import sys

    from actors.service.table import state_dir as module

    holder = lock_state_dir(tmp_path)
    real = fcntl.flock
    calls = []

    def flock_after_the_holder_let_go(handle, operation):
        if not calls:   # this process opened the old file; its holder now lets go, removing it
            module.release_state_dir(holder, tmp_path, [])
        calls.append(operation)
        return real(handle, operation)

    monkeypatch.setattr(module.fcntl, "flock", flock_after_the_holder_let_go)
    handle = lock_state_dir(tmp_path)
    monkeypatch.setattr(module.fcntl, "flock", real)
    try:
        lock = tmp_path / "scheduler.lock"
        assert os.fstat(handle.fileno()).st_ino == os.stat(lock).st_ino
        other = subprocess.run([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); "
                                "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(lock)], capture_output=True,
                               text=True)
        assert other.returncode != 0 and "BlockingIOError" in other.stderr, other
    finally:
        handle.close()
