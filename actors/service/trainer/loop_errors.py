"""A service loop's errors, logged so that one that repeats every tick (a damaged job table, a lost disk) is
one line a minute with its count, not a traceback a tick; a new or changed error is logged at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

REPEAT_EVERY_S = 60.0   # how often an error that keeps repeating is logged again, with its count


class LoopErrors:
    """`report` the error a loop's round ended with; `cleared` after a round that ended well."""

    def __init__(self, log: logging.Logger, what: str, *, quiet: tuple[type[BaseException], ...] = (),
                 every_s: float = REPEAT_EVERY_S, clock: Callable[[], float] = time.monotonic):
        """`quiet`: errors whose message says all there is (a traceback adds nothing): logged as one line."""
        self.log = log
        self.what = what
        self.quiet = quiet
        self.every_s = every_s
        self.clock = clock
        self.last: tuple[type, str] | None = None   # the error that is repeating
        self.repeats = 0                            # times it came again since it was last logged
        self.logged_at = 0.0

    def report(self, error: BaseException) -> None:
        key = (type(error), str(error))
        now = self.clock()
        if key == self.last and now - self.logged_at < self.every_s:
            self.repeats += 1
            return
        again = f" (again, {self.repeats + 1} times in {now - self.logged_at:.0f} s)" if key == self.last else ""
        if isinstance(error, self.quiet):
            self.log.error("%s: %s%s", self.what, error, again)
        else:
            self.log.error("%s: %s%s", self.what, str(error) or type(error).__name__, again, exc_info=error)
        self.last, self.repeats, self.logged_at = key, 0, now

    def cleared(self) -> None:
        """The loop's round ended well: an error that comes back is new, and logged at once."""
        if self.last is not None and self.repeats:
            self.log.info("%s: the error above came %d more time(s), then stopped", self.what, self.repeats)
        self.last, self.repeats = None, 0
