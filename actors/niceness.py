"""CPU priorities of the service's processes. On a CPU-only node the trainers' torch threads are the work
that matters, and their OpenMP threads wait for each other at every parallel region: a slice taken by
any other process stalls the whole step, not just one thread. So trainers run at nice 0, and the
service's light background processes (scheduler, job actors) step aside at `BACKGROUND_NICENESS`."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10


def normal_priority() -> None:
    """Ray starts workers at nice 15 (unless RAY_worker_niceness says otherwise); back to nice 0 where
    allowed (lowering niceness needs CAP_SYS_NICE)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError as error:
        log.info("trainer runs at nice %d (could not lower it: %s); start Ray with RAY_worker_niceness=0 "
                 "for full CPU speed", os.getpriority(os.PRIO_PROCESS, 0), error)


def background_priority() -> None:
    """Raise this process's niceness to `BACKGROUND_NICENESS` (never lowers it; always allowed)."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current < BACKGROUND_NICENESS:
        os.setpriority(os.PRIO_PROCESS, 0, BACKGROUND_NICENESS)
