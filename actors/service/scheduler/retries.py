"""Retrying a write that may succeed later: a few tries with a pause between them (a full disk may free up, a
store may answer again), each failure reported, the last one raised. The trainer's final writes of a leaving
job (its adapter and checkpoint, their upload) go through `with_retries`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

FINAL_WRITE_ATTEMPTS = 3          # tries to write a leaving job's results (adapter, checkpoint, their upload)
FINAL_WRITE_BACKOFF_S = (0.2, 1.0)


def with_retries(work: Callable[[], T], *, attempts: int = FINAL_WRITE_ATTEMPTS,
                 backoff_s: Sequence[float] = FINAL_WRITE_BACKOFF_S,
                 on_failure: Callable[[OSError, int, bool], None] | None = None,
                 go_on: Callable[[], bool] | None = None) -> T:
    """`work()`, tried again after an OSError up to `attempts` tries in all, the i-th pause `backoff_s[i]`
    seconds (its last value repeated). After each failed try `on_failure(error, tries so far, last)` is
    called (`last`: no try follows, the error is raised next); `go_on()`, asked after a failed try, ends the
    tries early when False. Errors other than OSError are raised at once."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(attempts):
        try:
            return work()
        except OSError as error:
            last = attempt + 1 == attempts or (go_on is not None and not go_on())
            if on_failure is not None:
                on_failure(error, attempt + 1, last)
            if last:
                raise
            time.sleep(backoff_s[min(attempt, len(backoff_s) - 1)])
    raise AssertionError("unreachable: the last try returns or raises")
