"""What a slow or hung plug-in policy's `decide` costs the rest of the service, bounded:

- a call that overran its time limit is left running in its thread (Python cannot stop a thread): one per policy at
  most (the next rounds are FIFO's while it runs), a daemon thread (the service's and the interpreter's exit do not
  wait for it), and said in the service's info (`policy_calls_left`) and the log, also once FIFO replaced the policy.
- the service's lock was held while `decide` ran (the round, under the lock and in one table transaction, waited for
  the policy up to `policy_timeout_s`): every submission, status call and cancel of every user waited behind a slow
  policy. The policy now decides on the round's snapshot with the lock released; its decisions are applied under the
  lock, each checked against the table then (a job cancelled meanwhile is not started).
- what a policy asks that is not done was said once per policy and job only while its key was among the 50 warnings
  the info shows: a policy asking the impossible of more jobs than that every round had every one said again every
  round (the log flooded). The said-once set is now kept apart, bounded by POLICY_SAID_ONCE_KEPT.

The references: the interpreter's own list of threads (`threading.enumerate`), a Python process's exit, the wall
clock, the job table's states and the log's lines."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

from actors.service.scheduler import policy_guard
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from policies.base import Start
from tests.helpers.fault_policies import DecidesOnManyGhosts, Hangs, LocksTheTableOnce, Slow, answered_within
from tests.helpers.policy_service import ServiceLoop, core_with, more_jobs
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status

TICK_S = 0.05   # ServiceLoop's tick


def policy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("scheduling-policy")]


def test_a_policy_that_never_returns_leaves_one_daemon_thread_said_in_the_info(tmp_path, caplog):
    limit_s = 0.2
    policy = Hangs()
    core, records = core_with(policy, tmp_path, limit_s=limit_s)
    before = set(policy_threads())
    counts = []
    try:
        with caplog.at_level(logging.WARNING), ServiceLoop(core) as service:
            assert policy.entered.wait(10), "the policy was never asked"
            deadline = time.monotonic() + 30 * limit_s   # many rounds, a submission now and then
            while time.monotonic() < deadline:
                counts.append(len(set(policy_threads()) - before))
                if len(counts) % 10 == 0:
                    service.locked(lambda: more_jobs(core, tmp_path, f"more{len(counts)}"))
                time.sleep(TICK_S)
            info = service.locked(core.guard.describe)
            left = [t for t in policy_threads() if t not in before]
    finally:
        policy.release.set()
    assert max(counts) == 1 and len(left) == 1, (counts, left)   # one call left running, never a second
    assert left[0].daemon   # the interpreter's exit does not wait for it
    assert policy.calls == 1 and core.policy.name == "fifo"
    assert info["policy_calls_left"] == 1, info
    assert info["policy_call_running"].startswith("policy 'hangs': its decide has run "), info
    assert info["policy_call_running"].endswith(
        f"s past its time limit ({limit_s:g} s, policy_timeout_s) in its thread, which cannot be stopped: it is "
        "left running (a daemon thread: the service's exit does not wait for it), and the policy is not called "
        "again while it runs"), info
    said = [r.getMessage() for r in caplog.records if "left running in its thread" in r.getMessage()]
    assert len(said) == 1, said


def test_the_loop_stops_within_the_time_limit_while_a_decide_hangs(tmp_path):
    """The service's stop waits for the round's wait at most (`policy_timeout_s`), not for the hung call."""
    limit_s = 1.0
    policy = Hangs()
    core, _ = core_with(policy, tmp_path, limit_s=limit_s)
    try:
        service = ServiceLoop(core).__enter__()
        assert policy.entered.wait(10), "the policy was never asked"
        started = time.monotonic()
        service.loop.stop(timeout=30)
        took = time.monotonic() - started
        assert not service.loop.thread.is_alive()
    finally:
        policy.release.set()
    assert took < limit_s + TICK_S + 1.0, took


def test_a_process_whose_policy_never_returns_exits(tmp_path):
    """The reference: a Python process that decides a round with a policy that never returns, then exits."""
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from tests.helpers.fault_policies import Hangs
        from tests.helpers.policy_service import core_with
        from tests.helpers.trainer import fake_status
        core, _ = core_with(Hangs(), Path({str(tmp_path)!r}), limit_s=0.2)
        core.plan([fake_status("trainer-0", "smollm2-135m")])
        print("decided", core.guard.describe()["policy_calls_left"], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "decided 1", (done.stdout, done.stderr[-2000:])


def test_submit_status_and_cancel_answer_at_once_while_a_slow_policy_decides(tmp_path):
    limit_s = 10.0
    policy = Slow(3.0)   # within its limit: its decisions are kept
    core, records = core_with(policy, tmp_path, limit_s=limit_s)
    with ServiceLoop(core) as service:
        assert policy.entered.wait(10), "the policy was never asked"
        time.sleep(0.2)   # well inside its call
        later, took_submit = answered_within(lambda: service.locked(lambda: more_jobs(core, tmp_path, "delta")), 10)
        status, took_status = answered_within(lambda: service.locked(lambda: core.table.find(records[0].id)), 10)
        cancelled, took_cancel = answered_within(lambda: service.locked(lambda: core.cancel(records[2].id)), 10)
        assert max(took_submit, took_status, took_cancel) < 0.5, (took_submit, took_status, took_cancel)
        assert status.id == records[0].id and cancelled[0].state == "cancelled"

        deadline = time.monotonic() + 30
        while not service.locked(lambda: service.rounds) and time.monotonic() < deadline:
            time.sleep(TICK_S)
        states = service.locked(lambda: {r.id: core.table.get(r.id).state for r in [*records, *later]})
        decided = service.locked(lambda: [a.job for actions in service.rounds for a in actions])
    # the policy's Start of the job cancelled while it decided was not carried out: it stays cancelled; the job
    # submitted meanwhile waits for the next round (the snapshot did not hold it)
    assert states == {records[0].id: "running", records[1].id: "running", records[2].id: "cancelled",
                      later[0].id: "queued"}, states
    assert decided == [records[0].id, records[1].id], decided
    assert [d.job for d in policy.answers[0]] == [r.id for r in records]   # it did start the cancelled one
    assert core.policy is policy and core.policy_error is None


def test_impossible_decisions_on_many_jobs_are_said_once_each_and_the_set_is_bounded(tmp_path, caplog, monkeypatch):
    ghosts = 120   # more than the info shows (POLICY_WARNINGS_KEPT)
    core, _ = core_with(DecidesOnManyGhosts(ghosts), tmp_path, names=("alpha",))
    status = fake_status("trainer-0", "smollm2-135m")
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            core.plan([status])
    said = [r.getMessage() for r in caplog.records if "'ghost-" in r.getMessage()]
    assert len(said) == ghosts, len(said)   # each once, not every round
    assert len(set(said)) == ghosts
    assert len(core.guard.describe()["policy_warnings"]) == policy_guard.POLICY_WARNINGS_KEPT
    # the said-once set is bounded too: a long service's policy asking the impossible of ever new jobs
    monkeypatch.setattr(policy_guard, "POLICY_SAID_ONCE_KEPT", 100)
    other, _ = core_with(DecidesOnManyGhosts(ghosts), tmp_path / "other", names=("alpha",))
    other.plan([status])
    assert len(other.guard.said) == 100


def test_a_service_stopped_while_its_round_waits_for_the_policy_drops_the_round_without_an_error(tmp_path, caplog):
    """A time limit longer than the stop waits for its loop (SchedulerActor.shutdown: 30 s): the shutdown goes on
    (the round waits with the lock released) and closes the table; the round then ends without writing to it."""
    policy = Hangs()
    core, _ = core_with(policy, tmp_path, limit_s=3.0)
    service = ServiceLoop(core).__enter__()
    try:
        with caplog.at_level(logging.INFO):
            assert policy.entered.wait(10), "the policy was never asked"
            service.loop.stop(timeout=0.2)   # the shutdown does not wait for the whole round
            took = answered_within(lambda: service.locked(core.table.close), 2)[1]   # the shutdown's closing
            service.loop.thread.join(10)
    finally:
        policy.release.set()
    assert took < 1.0 and not service.loop.thread.is_alive()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    assert service.rounds == []   # the round was dropped: nothing carried out
    assert "scheduler: the service stopped while its round waited for the policy; the round is dropped" in caplog.text


def test_decisions_the_table_cannot_take_are_dropped_whole_and_a_moved_jobs_start_is_still_carried_out(tmp_path,
                                                                                                   caplog):
    """The round's decisions are written in a transaction of their own, after the policy answered (the snapshot's,
    with the moved jobs' starts, was committed before it): one the table cannot take (another process holds its
    lock) writes none of the decisions and carries none out, the next round decides again; the moved job's start,
    written, is carried out (dropped, its job would be running in the table and on no trainer). The reference: the
    table's states, read once the other process let go."""
    path = tmp_path / "state/jobs.sqlite"
    policy = LocksTheTableOnce(path)
    core = SchedulerCore(JobTable(path, busy_timeout=0.3), policy, tmp_path / "state", policy_timeout_s=5.0)
    data = write_task_data(tmp_path / "data", "t")
    moved, waiting = core.submit_many(run_spec("smollm2-135m", tmp_path / "out", [job_dict(n, data, 5) for n in
                                                                                   ("alpha", "beta")]).submissions())
    core.scheduling.of(moved.id).moving_to = "trainer-1"   # its pause on trainer-0 has landed: it resumes there
    trainers = [fake_status("trainer-0", "smollm2-135m"), fake_status("trainer-1", "smollm2-135m")]
    try:
        with caplog.at_level(logging.WARNING):
            first = core.plan(trainers)
    finally:
        policy.release()
    assert first == [Start(moved.id, "trainer-1")]
    assert core.table.get(moved.id).state == "running" and core.table.get(moved.id).trainer == "trainer-1"
    assert core.table.get(waiting.id).state == "queued"   # the policy's Start of it was not written
    assert "the policy's decisions of this round were not written, the next round decides again" in caplog.text
    assert core.plan(trainers) == [Start(waiting.id, "trainer-0")]
    assert core.table.get(waiting.id).state == "running"
