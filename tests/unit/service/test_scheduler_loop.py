"""The scheduler's loop thread (actors/service/scheduler/scheduler_loop.py): a decision round that takes long holds the
next one back so that rounds take at most ROUND_SHARE of the time, short rounds run every tick; a tick that fails
(the job table busy, any other error) is logged and the loop goes on; `stop` ends it after the tick that runs."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from actors.service.scheduler import scheduler_loop
from actors.service.scheduler.scheduler_loop import ROUND_PACED_FROM_S, ROUND_SHARE, SchedulerLoop
from actors.service.table.job_table import JobTableBusy
from tests.helpers.service import wait_for

pytestmark = pytest.mark.unit


def test_a_long_round_holds_the_next_back_by_its_share_and_short_ones_run_every_tick():
    loop = SchedulerLoop(lambda: None, threading.Lock(), tick_seconds=1.0)
    numbers: list[int] = []
    for _ in range(3):   # short rounds: each runs
        loop.paced_round(numbers.append)
    assert numbers == [1, 2, 3]
    took = 5 * ROUND_PACED_FROM_S

    def long_round(number: int) -> None:
        numbers.append(number)
        time.sleep(took)

    started = time.monotonic()
    loop.paced_round(long_round)
    # held back until the round's time is ROUND_SHARE of the time since it started (at least took / ROUND_SHARE)
    assert loop.next_round_at >= started + took / ROUND_SHARE - 1e-6
    loop.paced_round(numbers.append)
    assert numbers == [1, 2, 3, 4] and loop.rounds == 4
    loop.next_round_at = time.monotonic()   # its time has come
    loop.paced_round(numbers.append)
    assert numbers == [1, 2, 3, 4, 5]


def test_a_failing_tick_is_logged_and_the_loop_goes_on_until_stopped(caplog):
    ticks: list[int] = []
    lock = threading.Lock()

    def tick() -> None:
        assert not lock.acquire(blocking=False), "a tick runs under the service's lock"
        ticks.append(len(ticks))
        if len(ticks) == 1:
            raise JobTableBusy("the job table is locked by another process")
        if len(ticks) == 2:
            raise RuntimeError("a listener broke")

    loop = SchedulerLoop(tick, lock, tick_seconds=0.01)
    with caplog.at_level(logging.INFO, logger=scheduler_loop.__name__):
        loop.start()
        wait_for(lambda: len(ticks) >= 4, timeout=10, what="ticks after the failing ones")
        loop.stop(timeout=10)
    assert not loop.thread.is_alive()
    stopped_at = len(ticks)
    time.sleep(0.05)
    assert len(ticks) == stopped_at   # no tick after the stop
    messages = [record.getMessage() for record in caplog.records]
    assert any("the job table is locked by another process; the next round tries again" in m for m in messages)
    assert any("error in the scheduling loop" in m and "a listener broke" in m for m in messages), messages


def test_a_rounds_wait_for_the_policy_with_the_lock_released_holds_the_next_back_by_as_long_not_by_its_share():
    """The reference: the wall clock at each round's start. A round that waits `policy_s` for the policy off the lock
    (its own time a few ms) is followed by the next one `policy_s` after it ended, not `policy_s / ROUND_SHARE` (15 s)
    after it started."""
    policy_s = 0.3
    begun: list[float] = []
    lock = threading.Lock()

    def decide(number: int) -> None:
        begun.append(time.monotonic())
        with loop.unlocked():
            assert lock.acquire(blocking=False), "the lock is released while the policy decides"
            lock.release()
            time.sleep(policy_s)

    loop = SchedulerLoop(lambda: loop.paced_round(decide), lock, tick_seconds=0.01)
    loop.start()
    try:
        wait_for(lambda: len(begun) >= 3, timeout=10, what="three rounds")
    finally:
        loop.stop(timeout=10)
    gaps = [later - earlier for earlier, later in zip(begun, begun[1:], strict=False)]
    assert all(2 * policy_s - 0.01 <= gap < 2 * policy_s + 1.0 for gap in gaps[:2]), gaps
