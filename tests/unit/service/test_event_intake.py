"""The job table's intake of trainer events, without Ray (`actors/service/events/event_intake.py`), over a real
job table and scheduler core: while another process holds the table's file (an operator's `BEGIN
EXCLUSIVE`), events wait and are tried again with doubling backoff, then land once and in order; a lost
trainer's jobs are queued again only after everything it reported before is booked; what the table could
not take before the service stopped is written beside it and booked at the next start."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path

from actors.service.events.event_intake import TABLE_RETRY_S, EventIntake, TrainerLost
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.table.state_dir import UNAPPLIED_EVENTS
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.fifo import FifoPolicy
from tests.helpers.scheduler_fakes import BUSY_S, Clock, progress, running_jobs


@contextlib.contextmanager
def locked(path: Path):
    """Another process's write lock on the table's file, as an operator's `sqlite3` shell takes it."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def committed_state(path: Path, job_id: str) -> str:
    """The job's state as another connection reads it: only what was committed."""
    with contextlib.closing(sqlite3.connect(path)) as reader:
        return reader.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]


def test_events_wait_for_a_locked_table_with_backoff_and_land_once_in_order(tmp_path, caplog):
    table, core, (a, _) = running_jobs(tmp_path)
    clock = Clock()
    heard: list[tuple[str, str, int]] = []
    calls: list[int] = []
    intake = EventIntake(table, core, tmp_path / "state", clock=clock,
                         on_events=lambda trainer, events: (calls.append(len(events)), heard.extend(
                             (trainer, event.kind, event.step) for event in events)))
    done = TrainerEvent(kind="completed", job_id=a, step=3, data={"reason": "max_steps reached"})
    with locked(table.path), caplog.at_level(logging.WARNING):
        intake.put("trainer-0", [progress(a, 1), progress(a, 2)])
        delays = []
        for _ in range(7):
            assert not intake.apply_all()
            delays.append(intake.retry_at - clock.now)
            tries = caplog.text.count("wait for the job table")
            clock.now = intake.retry_at - 0.01      # just before the backoff ends: not even tried
            assert not intake.apply_all() and caplog.text.count("wait for the job table") == tries
            clock.now = intake.retry_at
        intake.put("trainer-0", [progress(a, 3), done])
        assert intake.waiting() == 4 and intake.waiting("trainer-0") == 4 and intake.waiting("trainer-9") == 0
        assert heard == [] and committed_state(table.path, a) == "running"
    # doubling from the first delay up to the cap
    assert delays == [min(TABLE_RETRY_S[0] * 2**i, TABLE_RETRY_S[1]) for i in range(7)]
    assert delays[-1] == TABLE_RETRY_S[1]
    assert intake.apply_all()        # the lock is gone: everything lands, in the order it was reported
    assert heard == [("trainer-0", "progress", 1), ("trainer-0", "progress", 2), ("trainer-0", "progress", 3),
                     ("trainer-0", "completed", 3)]
    assert calls == [3, 1]           # the progress in one call, then the end after its state change
    assert [row["step"] for row in table.progress.of_job(a)] == [1, 2, 3]
    assert table.get(a).state == "completed" and table.get(a).tokens == 300
    assert intake.waiting() == 0 and intake.backoff == TABLE_RETRY_S[0]   # the next lock starts again short
    assert intake.apply_all() and len(heard) == 4 and len(table.progress.of_job(a)) == 3   # nothing booked twice


def test_the_listeners_hear_a_jobs_last_progress_before_its_end(tmp_path):
    """What the trainer reported in one poll, a job's last steps then its end, reaches the listeners in that
    order: its progress (published on MQTT as jobs/<id>/progress) before its state change (jobs/<id>/state),
    for an end the trainer reports (completed) as for one the user asked for (cancelled)."""
    table, core, (a, b) = running_jobs(tmp_path)
    heard: list[tuple[str, str, object]] = []
    table.on_change = lambda record, previous: heard.append((record.id, "state", record.state))
    intake = EventIntake(table, core, tmp_path / "state", on_events=lambda trainer, events: heard.extend(
        (event.job_id, event.kind, event.step) for event in events if event.kind == "progress"))
    intake.put("trainer-0", [progress(a, 1), progress(b, 1), progress(a, 2),
                             TrainerEvent(kind="completed", job_id=a, step=2, data={"reason": "max_steps reached"}),
                             progress(b, 2), TrainerEvent(kind="cancelled", job_id=b, step=2, data={"reason": "user"})])
    assert intake.apply_all()
    assert heard == [(a, "progress", 1), (b, "progress", 1), (a, "progress", 2), (a, "state", "completed"),
                     (b, "progress", 2), (b, "state", "cancelled")]


def test_a_lost_trainers_jobs_are_queued_again_only_after_what_it_reported_before(tmp_path):
    table, core, (a, b) = running_jobs(tmp_path)
    requeued: list[tuple[str, str]] = []
    heard: list[str] = []
    intake = EventIntake(table, core, tmp_path / "state",
                         on_events=lambda trainer, events: heard.append(",".join(e.kind for e in events)),
                         on_requeued=lambda job_id: (heard.append(f"requeued {job_id}"),
                                                     requeued.append((job_id, committed_state(table.path, job_id)))))
    intake.put("trainer-0", [progress(a, 1), TrainerEvent(kind="completed", job_id=a, step=1, data={"reason": "done"}),
                             progress(b, 1)])
    intake.put("trainer-0", [TrainerLost("ActorDiedError")])
    assert intake.apply_all()
    # what it reported (split before the end: a's progress is heard before its state change), then the loss
    assert heard == ["progress", "completed,progress", f"requeued {b}"]
    assert table.get(a).state == "completed"       # finished before the loss: not run again
    record = table.get(b)
    assert record.state == "queued" and record.trainer is None
    assert "trainer trainer-0 was lost (ActorDiedError)" in record.reason and record.step == 1
    assert requeued == [(b, "queued")]             # heard once committed
    assert core.scheduling[b].replace_job_actor        # it gets a new job actor (the old one may be gone with it)


def test_what_a_locked_table_did_not_take_before_the_stop_is_booked_at_the_next_start(tmp_path):
    table, core, (a, b) = running_jobs(tmp_path)
    clock = Clock()
    state_dir = tmp_path / "state"
    intake = EventIntake(table, core, state_dir, clock=clock)
    reported = [progress(a, 1), progress(a, 2), TrainerEvent(kind="completed", job_id=a, step=2,
                                                             data={"reason": "done"}),
                TrainerEvent(kind="eval", job_id=b, step=1, data={"eval_loss": 1.5})]
    with locked(table.path):
        intake.put("trainer-0", reported[:3])
        intake.put("trainer-1", reported[3:])
        intake.put("trainer-1", [TrainerLost("the service stopped")])
        assert not intake.drain(timeout_s=5.0, sleep=clock.sleep)     # tried every second, then gave up
        assert clock.now >= 1005.0
        spilled = intake.spill()
    assert spilled == state_dir / UNAPPLIED_EVENTS
    assert len(spilled.read_text().splitlines()) == 4     # the events; the lost trainer is left to `recover`
    assert table.progress.of_job(a) == [] and table.get(a).state == "running"
    table.close()

    table = JobTable(state_dir / "jobs.sqlite", busy_timeout=BUSY_S)   # the next start
    core = SchedulerCore(table, FifoPolicy(), state_dir)
    again = EventIntake(table, core, state_dir)
    assert again.replay() == 4
    assert not spilled.exists()
    assert [row["step"] for row in table.progress.of_job(a)] == [1, 2] and table.get(a).state == "completed"
    assert table.get(b).eval_loss == 1.5
    assert again.replay() == 0 and len(table.progress.of_job(a)) == 2    # booked once


def test_a_drain_with_the_table_free_books_everything_and_spills_nothing(tmp_path):
    table, core, (a, _) = running_jobs(tmp_path)
    intake = EventIntake(table, core, tmp_path / "state")
    intake.put("trainer-0", [progress(a, 1)])
    assert intake.drain(timeout_s=5.0)
    assert intake.spill() is None and not (tmp_path / "state" / UNAPPLIED_EVENTS).exists()
    assert [row["step"] for row in table.progress.of_job(a)] == [1]
