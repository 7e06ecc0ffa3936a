"""CPU priorities of the service's processes. On a CPU-only node the trainers' torch threads are the work
that matters, and their OpenMP threads wait for each other at every parallel region: a slice taken by
any other process stalls the whole step, not just one thread. So trainers run at nice 0, and the
service's light background processes (scheduler, job actors) at nice `BACKGROUND_NICENESS`.

Not SCHED_IDLE: under it a job actor gets almost no CPU while a trainer keeps both cores of a small
machine busy, so jobs that are still reading their data wait for the trainer's other jobs to end
(measured with bench/overhead.py: two of four jobs submitted together joined 20 steps late).

Linux priorities belong to threads, not processes: each function here sets every thread the process
has (Ray's worker starts its own threads before any actor code runs); threads started later inherit the
setting of the thread that starts them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10


def thread_ids() -> list[int]:
    """This process's threads (Linux); just the process where /proc is not there."""
    try:
        return sorted(int(entry.name) for entry in Path("/proc/self/task").iterdir())
    except OSError:
        return [0]


def normal_priority() -> None:
    """Ray starts workers at nice 15 (unless RAY_worker_niceness says otherwise); back to nice 0 where
    allowed (lowering niceness needs CAP_SYS_NICE)."""
    for thread in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, thread) > 0:
                os.setpriority(os.PRIO_PROCESS, thread, 0)
        except OSError as error:
            log.info("trainer thread %d runs at nice %d (could not lower it: %s); start Ray with "
                     "RAY_worker_niceness=0 for full CPU speed", thread, os.getpriority(os.PRIO_PROCESS, thread),
                     error)
            return


def background_priority() -> None:
    """Every thread of this process to at least `BACKGROUND_NICENESS` (never lowers it; always allowed)."""
    for thread in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, thread) < BACKGROUND_NICENESS:
                os.setpriority(os.PRIO_PROCESS, thread, BACKGROUND_NICENESS)
        except ProcessLookupError:
            continue   # the thread ended meanwhile
