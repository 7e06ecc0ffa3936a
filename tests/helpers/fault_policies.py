"""Plug-in policies that misbehave, as third-party code may: loaded by name (`module:Class`) by the fault
tests, in-process and in the service's scheduler actor."""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import time
from pathlib import Path

from policies.base import Decision, Move, Preempt, Snapshot, Start, Wait
from policies.fifo import FifoPolicy


class FailsOnPoison(FifoPolicy):
    """FIFO, except that it raises whenever a queued job is named `poison`."""

    name = "fails-on-poison"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        if any(j.name == "poison" and j.state == "queued" for j in snapshot.jobs):
            raise ZeroDivisionError("poison pill")
        return super().decide(snapshot)


class AlwaysFails:
    name = "always-fails"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        raise RuntimeError("this policy is broken")


class AnswersGarbage:
    name = "answers-garbage"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return ["start everything"]   # type: ignore[list-item]


class Hangs(FifoPolicy):
    """FIFO, but its `decide` blocks until `release` is set (a plug-in stuck on a lock or a network call); it
    counts its calls, and how many ran at once at most."""

    name = "hangs"

    def __init__(self, release: threading.Event | None = None, first_only: bool = False):
        self.release = release or threading.Event()
        self.first_only = first_only   # only its first call blocks; the later ones answer at once
        self.entered = threading.Event()
        self.calls = self.running = self.most_at_once = 0
        self.lock = threading.Lock()

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
            blocks = self.calls == 1 or not self.first_only
        try:
            self.entered.set()
            if blocks:
                self.release.wait()
            return super().decide(snapshot)
        finally:
            with self.lock:
                self.running -= 1


class PreemptsQueued(FifoPolicy):
    """FIFO, and a Preempt of every queued job it does not start (a plug-in that lost track of the jobs' states)."""

    name = "preempts-queued"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        decisions = super().decide(snapshot)
        started = {d.job for d in decisions if isinstance(d, Start)}
        return [*decisions, *(Preempt(j.id, "make room") for j in snapshot.queued() if j.id not in started)]


class RepeatsImpossible(FifoPolicy):
    """FIFO, and every round a Start of each running job on its own trainer, a Move of it to a trainer that does not
    exist, and a Start of each queued job FIFO leaves waiting on that trainer (a plug-in that decides from a stale
    view of the jobs and trainers)."""

    name = "repeats-impossible"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        decisions = super().decide(snapshot)
        started = {d.job for d in decisions if isinstance(d, Start)}
        running = [j for j in snapshot.jobs if j.state == "running"]
        return [*decisions, *(Start(j.id, j.trainer or "none") for j in running),
                *(Move(j.id, "trainer-9", "rebalance") for j in running),
                *(Start(j.id, "trainer-9") for j in snapshot.queued() if j.id not in started)]


class DecidesOnGhosts(FifoPolicy):
    """FIFO, and a Start of a job id that does not exist (a plug-in that keeps ids from an earlier snapshot)."""

    name = "decides-on-ghosts"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        trainer = snapshot.trainers[0].id if snapshot.trainers else "none"
        return [*super().decide(snapshot), Start("ghost-job", trainer)]


class FreeFormCauses:
    """Every queued job waits, with a cause of its own (a plug-in that puts the job's id and a number in it)."""

    name = "free-form-causes"

    def __init__(self) -> None:
        self.rounds = 0

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        self.rounds += 1
        return [Wait(j.id, f"held back by free-form ({self.rounds})", f"waiting on {j.id} #{self.rounds}")
                for j in snapshot.queued()]


class HangsOnPoison(FifoPolicy):
    """FIFO, except that its `decide` never returns once a queued job is named `poison` (a plug-in stuck in a loop on
    one job's data): loaded by name in the service's scheduler actor."""

    name = "hangs-on-poison"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        if any(j.name == "poison" and j.state == "queued" for j in snapshot.jobs):
            threading.Event().wait()
        return super().decide(snapshot)


class ComposesAndHangs(FifoPolicy):
    """FIFO that also composes steps (each step: the first job alone), whose `decide` hangs from its second call until
    `release` (60 s at most); it counts its `compose_step` calls made while a `decide` of its runs (both use its
    state, as a policy that keeps its jobs' picture between them would)."""

    name = "composes-and-hangs"

    def __init__(self):
        self.release = threading.Event()
        self.calls = self.deciding = self.composed = self.overlaps = 0

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        self.calls += 1
        self.deciding += 1
        try:
            if self.calls > 1:
                self.release.wait(60)
            return super().decide(snapshot)
        finally:
            self.deciding -= 1

    def compose_step(self, batches, cost, step_tokens, fits) -> list[str]:
        self.composed += 1
        self.overlaps += self.deciding > 0
        return [batches[0].job]


def answered_within(call, seconds: float):
    """`call()`'s answer and how long it took, made in a thread of its own (as a client's call comes in), or fail
    where it takes longer than `seconds` (a call that never returns does not hang the test)."""
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not answer within {seconds} s (the scheduler's lock is held)"
    return answer[0], time.monotonic() - started


class Slow(FifoPolicy):
    """FIFO, after `seconds` (a plug-in that is slow on a large queue but within its time limit); `entered` is set
    when a call begins, `answers` holds what each call answered."""

    name = "slow"

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.entered = threading.Event()
        self.answers: list[list[Decision]] = []

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        self.entered.set()
        time.sleep(self.seconds)
        self.answers.append(super().decide(snapshot))
        return self.answers[-1]


class DecidesOnManyGhosts(FifoPolicy):
    """FIFO, and a Start of each of `count` job ids that do not exist, every round (a plug-in that keeps ids from
    long ago, on a service with many jobs)."""

    name = "decides-on-many-ghosts"

    def __init__(self, count: int):
        self.count = count

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        trainer = snapshot.trainers[0].id if snapshot.trainers else "none"
        return [*super().decide(snapshot), *(Start(f"ghost-{n}", trainer) for n in range(self.count))]


class SlowOnSlow(FifoPolicy):
    """FIFO, but its `decide` takes SECONDS while a job named `slow` is queued (within the service's time limit,
    so its answer is kept); loaded by name by the service test."""

    name = "slow-on-slow"
    SECONDS = 6.0

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        if any(job.name == "slow" and job.state == "queued" for job in snapshot.jobs):
            time.sleep(self.SECONDS)
        return super().decide(snapshot)


class LocksTheTableOnce(FifoPolicy):
    """FIFO, but its first `decide` has another connection take the job table's write lock (as a backup or an open
    `sqlite3` shell does) and hold it until `release()`."""

    name = "locks-the-table-once"

    def __init__(self, path):
        self.path = path
        self.holder = None

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        if self.holder is None:
            self.holder = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.holder.execute("BEGIN IMMEDIATE")
        return super().decide(snapshot)

    def release(self) -> None:
        self.holder.execute("ROLLBACK")
        self.holder.close()


class GatedOnFile(FifoPolicy):
    """FIFO, but its first call on a snapshot where a job named `gated` is queued answers only once the test lets it
    (a plug-in that is slow on that round; loaded by name by a service test, so it runs in the scheduler's process):
    it writes `gate(job id, "entered")` and waits for `gate(job id, "go")` (at most SECONDS)."""

    name = "gated-on-file"
    SECONDS = 120.0

    def __init__(self) -> None:
        self.held: set[str] = set()

    @staticmethod
    def gate(job_id: str, which: str) -> Path:
        return Path(tempfile.gettempdir()) / f"aspen-gate-{job_id}.{which}"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        answer = super().decide(snapshot)
        for job in snapshot.jobs:
            if job.name == "gated" and job.state == "queued" and job.id not in self.held:
                self.held.add(job.id)
                self.gate(job.id, "entered").touch()
                deadline = time.monotonic() + self.SECONDS
                while not self.gate(job.id, "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        return answer
