"""How long an idle trainer's tick waits before it lets queued calls in.

The trainer actor takes one call at a time and drives itself with `tick` calls (actors/trainer_actor.py): an
idle tick waits, then queues the next. Each tick is an actor task (a Ray task submission and its reply): at
20 ticks a second an idle trainer took 6.6% of a core on the 2-core CI machine (the cluster's idle total was
12%). While work is at hand or was a moment ago (jobs assigned, interactive models open, a step just run), a
call waits at most `short_s` behind the tick; once the trainer has been quiet for `quiet_after_s`, the tick
waits `long_s`: the first call after a quiet spell (an assignment, a poll) then waits at most that long, once,
and the pace is short again from the next tick."""

from __future__ import annotations

import time
from collections.abc import Callable

SHORT_WAIT_S = 0.05     # while work is at hand: an assignment or a Tinker call waits at most this behind a tick
LONG_WAIT_S = 0.5       # after a quiet spell: 2 ticks a second instead of 20
QUIET_AFTER_S = 5.0     # how long without work before the long wait


class IdlePace:
    """The idle wait of the next tick: `short_s` while busy or busy within `quiet_after_s`, else `long_s`."""

    def __init__(self, short_s: float = SHORT_WAIT_S, long_s: float = LONG_WAIT_S,
                 quiet_after_s: float = QUIET_AFTER_S, clock: Callable[[], float] = time.monotonic):
        if not 0 < short_s <= long_s:
            raise ValueError(f"idle waits must be 0 < short_s <= long_s, not {short_s} and {long_s}")
        self.short_s, self.long_s, self.quiet_after_s = short_s, long_s, quiet_after_s
        self.clock = clock
        self.busy_at = clock()

    def next_wait(self, busy: bool) -> float:
        """The wait for a tick that finds the trainer `busy` (work at hand) or not."""
        now = self.clock()
        if busy:
            self.busy_at = now
        return self.short_s if now - self.busy_at < self.quiet_after_s else self.long_s
