"""The scheduler loop's error log: an error that repeats every tick (a damaged job table) is one line a minute
with its count, a new error is logged at once, and a quiet error never carries a traceback."""

from __future__ import annotations

import logging

from actors.service.table.table_backup import JobTableDamaged
from actors.service.trainer.loop_errors import LoopErrors


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_error_repeating_every_tick_is_logged_once_a_minute_with_its_count(caplog):
    clock = Clock()
    log = logging.getLogger("test.loop")
    errors = LoopErrors(log, "scheduler: error in the scheduling loop", quiet=(JobTableDamaged,), clock=clock)
    damaged = "the job table /s/jobs.sqlite is damaged (file is not a database); to go back to its backup: ..."
    with caplog.at_level(logging.INFO, logger="test.loop"):
        for _ in range(150):   # 150 ticks of 1 s, each meeting the damaged table
            errors.report(JobTableDamaged(damaged))
            clock.now += 1.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"scheduler: error in the scheduling loop: {damaged}",
                     f"scheduler: error in the scheduling loop: {damaged} (again, 60 times in 60 s)",
                     f"scheduler: error in the scheduling loop: {damaged} (again, 60 times in 60 s)"]
    assert all(r.exc_info is None for r in caplog.records)   # the message says it all: no traceback


def test_a_new_error_is_logged_at_once_with_its_traceback_and_an_end_of_repeats_is_said(caplog):
    clock = Clock()
    log = logging.getLogger("test.loop")
    errors = LoopErrors(log, "loop", quiet=(JobTableDamaged,), clock=clock)
    with caplog.at_level(logging.INFO, logger="test.loop"):
        for _ in range(3):
            try:
                raise ValueError("bad value")
            except ValueError as error:
                errors.report(error)
            clock.now += 1.0
        errors.report(KeyError("job-1"))       # another error: at once
        errors.report(KeyError("job-1"))       # its repeat: counted
        errors.cleared()                      # a round that ended well
        errors.report(KeyError("job-1"))       # after a good round: new again
    records = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert records == [("ERROR", "loop: bad value", True),
                       ("ERROR", "loop: 'job-1'", True),
                       ("INFO", "loop: the error above came 1 more time(s), then stopped", False),
                       ("ERROR", "loop: 'job-1'", True)]
    assert "raise ValueError" in caplog.text   # the traceback is there for an unexpected error
