"""CPU priorities of the service's processes. On a CPU-only node the trainers' torch threads are the work
that matters, and their OpenMP threads wait for each other at every parallel region: a slice taken by
any other process stalls the whole step, not just one thread. So trainers run at nice 0, and the
service's light background processes (scheduler, job actors) at nice `BACKGROUND_NICENESS`.

A job actor, once its data is read and tokenized, only serves micro-batches ahead of time and books
losses, yet its process wakes 100 times a second like every Ray worker (the core worker checks for
signals every 10 ms): a few such processes cost a 2-core trainer a few percent. So from then on it runs
under Linux's SCHED_IDLE policy (`idle_priority`): it gets a core only when no normal thread wants one,
and its wake-ups never preempt a trainer thread. Not before: under SCHED_IDLE a job actor still reading
its data gets almost no CPU while a trainer keeps both cores busy (measured with bench/overhead.py: two
of four jobs submitted together joined 20 steps late). Not the scheduler either: users wait on it.

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


def idle_priority() -> None:
    """Every thread of this process to SCHED_IDLE (Linux); `background_priority` where there is none.
    Always allowed: it only lowers the priority."""
    idle = getattr(os, "SCHED_IDLE", None)
    if idle is None:
        background_priority()
        return
    for thread in thread_ids():
        try:
            os.sched_setscheduler(thread, idle, os.sched_param(0))
        except ProcessLookupError:
            continue   # the thread ended meanwhile
