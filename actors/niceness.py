"""CPU priorities of the service's processes. On a CPU-only node the trainers' torch threads are the work
that matters, and their OpenMP threads wait for each other at every parallel region: a slice taken by
any other process stalls the whole step, not just one thread. So trainers run at nice 0, and the
service's light background processes (scheduler, job actors) at nice `BACKGROUND_NICENESS`.

A job actor, once its data is read and tokenized, only serves micro-batches ahead of time and books
losses, yet its process wakes 100 times a second like every Ray worker (the core worker checks for
signals every 10 ms). So from then on it runs at the lowest priority, nice `LOWEST_NICENESS` (19): a
fiftieth of a nice-0 thread's share of a contested core, and (under EEVDF, Linux 6.6+) a virtual deadline
so far off that its wake-ups seldom preempt a trainer thread. Not Linux's SCHED_IDLE, as it was until
2026-11-30: a trainer waits for its job actors' micro-batches, and on a node where other work keeps the
cores busy (other users' processes; the test suite's other worker) a SCHED_IDLE job actor got almost no
CPU and its trainer stalled: two priority jobs beside two busy processes on 2 cores trained in 292 s with
SCHED_IDLE job actors, 165 s at nice 19, 125 s at nice 10 (tests/service/test_scheduling_service.py, one
run each), while on a node of its own SCHED_IDLE had shown no measurable gain over nice 10
(docs/benchmarks.md, "overhead"). Not before its data is read either: a job actor still tokenizing at
the lowest priority joins late beside a busy trainer (measured with bench/overhead.py under SCHED_IDLE:
two of four jobs submitted together joined 20 steps late). Not the scheduler: users wait on it.

Linux priorities belong to threads, not processes: each function here sets every thread the process
has (Ray's worker starts its own threads before any actor code runs); threads started later inherit the
setting of the thread that starts them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

BACKGROUND_NICENESS = 10
LOWEST_NICENESS = 19


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
    """Every thread of this process to nice `BACKGROUND_NICENESS`: raised from below it (always allowed),
    lowered from above where allowed (a cluster whose workers start at Ray's default 15: there a scheduler
    got a third of its share beside busy trainers and fell behind their steps; lowering niceness needs
    CAP_SYS_NICE, so elsewhere it stays where Ray started it)."""
    _set_niceness(BACKGROUND_NICENESS)


def lowest_priority() -> None:
    """Every thread of this process to nice `LOWEST_NICENESS` (only ever raised: always allowed)."""
    _set_niceness(LOWEST_NICENESS)


def _set_niceness(niceness: int) -> None:
    for thread in thread_ids():
        try:
            if os.getpriority(os.PRIO_PROCESS, thread) != niceness:
                os.setpriority(os.PRIO_PROCESS, thread, niceness)
        except ProcessLookupError:
            continue   # the thread ended meanwhile
        except PermissionError as error:   # lowering niceness without CAP_SYS_NICE
            log.info("thread %d stays at nice %d (could not set %d: %s)", thread,
                     os.getpriority(os.PRIO_PROCESS, thread), niceness, error)
            return
