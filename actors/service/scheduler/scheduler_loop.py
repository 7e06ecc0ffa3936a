"""The scheduler's loop thread (`SchedulerLoop`, which `SchedulerActor` holds), Ray-free: its tick under the
service's lock every `tick_seconds` until the service stops, and the pace of its decision rounds.

A decision round (snapshot, policy, listeners) may take at most `ROUND_SHARE` of the scheduler's time, so that a
submission rarely waits behind one: with thousands of queued jobs rounds come less often than the ticks (a 40 ms
round: every 2 s); trainer events are still taken every tick. A round the job table could not take (JobTableBusy)
left nothing half done and is tried at the next tick; any other error of a tick is logged (`LoopErrors`: a repeat
once a minute) and the loop goes on.

ROUND_SHARE bounds the round's own time, under the lock, the service's. The time it waited for the policy with the
lock released (`unlocked`: the policy's `decide` in its thread, bounded by `policy_timeout_s`, policy_clock.py) is
not paced by it: it holds the next round back by as long again after the round ended (the policy's thread busy half
of the time at most), so by `policy_timeout_s` at most. Paced by ROUND_SHARE, a policy that answered in 3 s held
the next round back 150 s (3 s / 2 %), and a job submitted meanwhile waited that long for its start; a hung
policy's first round, 250 s (5 s / 2 %). The rule, in docs/scheduling.md ("Round pace"): the next round starts no
sooner than max(started + own / ROUND_SHARE, ended + policy).

The policy's wait runs with the service's lock released (`unlocked`, which SchedulerCore.plan is given): the round
held it while the policy decided, up to `policy_timeout_s`, and every submission, status call and cancel waited
behind a slow policy; the round's decisions are applied under the lock again, each checked against the table then.
A stop that came meanwhile (the service's shutdown, which waits for the loop at most 30 s and may then close the
table) drops the round (`LoopStopped`): nothing of its decisions is written or carried out."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from actors.service.table.job_table import JobTableBusy
from actors.service.table.table_backup import JobTableDamaged
from actors.service.trainer.loop_errors import LoopErrors

log = logging.getLogger(__name__)

ROUND_SHARE = 0.02
ROUND_PACED_FROM_S = 0.01   # rounds shorter than this (a table of tens of jobs) run every tick


class LoopStopped(BaseException):
    """The loop was stopped while its round waited for the policy with the lock released: the round is dropped. A
    BaseException, so that the policy guard's handlers of a policy's own exceptions let it through."""


class SchedulerLoop:
    """`tick` (under `lock`) every `tick_seconds` in a thread of its own, from `start` until `stop`;
    `paced_round` runs a decision round when its share of the time allows."""

    def __init__(self, tick: Callable[[], None], lock: Any, tick_seconds: float):
        self.tick = tick
        self.lock = lock
        self.tick_seconds = tick_seconds
        self.rounds = 0                    # decision rounds run so far
        self.next_round_at = 0.0           # monotonic time before which no decision round starts (ROUND_SHARE)
        self.unlocked_s = 0.0              # how long this round ran with the lock released (`unlocked`)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="scheduler-loop", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """No tick after the one running now, which is waited for (at most `timeout`)."""
        self.stopping.set()
        self.thread.join(timeout=timeout)

    @contextlib.contextmanager
    def unlocked(self) -> Iterator[None]:
        """The service's lock released for what runs inside, where the caller is this loop's tick (which holds it
        once, `_run`); elsewhere (a test's direct call) nothing changes. The caller holds no table transaction."""
        if threading.current_thread() is not self.thread:
            yield
            return
        self.lock.release()
        released = time.monotonic()
        try:
            yield
        finally:
            self.lock.acquire()
            self.unlocked_s += time.monotonic() - released
        if self.stopping.is_set():
            raise LoopStopped("the service stopped while its round waited for the policy; the round is dropped")

    def paced_round(self, decide: Callable[[int], object]) -> None:
        """`decide(n)`, the n-th decision round, unless the last one's time keeps the next one back: its own time
        (with the lock held) by ROUND_SHARE, its wait for the policy (with the lock released, `unlocked`) by as long
        again after it ended."""
        started = time.monotonic()
        if started < self.next_round_at:
            return
        self.rounds += 1
        self.unlocked_s = 0.0
        decide(self.rounds)
        ended = time.monotonic()
        policy = self.unlocked_s
        own = ended - started - policy
        paced = started + own / ROUND_SHARE if own > ROUND_PACED_FROM_S else 0.0
        self.next_round_at = max(paced, ended + policy)

    def _run(self) -> None:
        errors = LoopErrors(log, "scheduler: error in the scheduling loop", quiet=(JobTableDamaged,))
        while not self.stopping.is_set():
            try:
                with self.lock:
                    self.tick()
                errors.cleared()
            except JobTableBusy as error:   # a decision round the table could not take: nothing of it happened
                log.warning("scheduler: %s; the next round tries again", error)
            except LoopStopped as stopped:
                log.info("scheduler: %s", stopped)
            except Exception as error:  # noqa: BLE001 - the loop goes on; LoopErrors logs it (a repeat once a minute)
                errors.report(error)
            self.stopping.wait(self.tick_seconds)
