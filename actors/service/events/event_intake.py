"""The job table's intake of what trainers report: a queue per trainer, booked in order, retried with
backoff while the table is locked, written to a file at a stop and booked at the next start.

Polled events (and the loss of a trainer) wait in their trainer's queue until the table has taken them, one
transaction per trainer and batch. While another process holds the table's file the queues stay as they
are; what the table still could not take when the service stops is written beside it (`state_dir.py`).
Nothing a trainer reports is lost or booked twice."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from actors.service.table.job_table import JobTable, JobTableBusy
from actors.service.table.state_dir import (
    UNAPPLIED_EVENTS,
    forget_spilled_events,
    read_spilled_events,
    spill_events,
)
from actors.service.trainer.trainer_reports import TrainerEvent

log = logging.getLogger(__name__)

TABLE_RETRY_S = (0.5, 10.0)     # backoff between tries to write what the job table could not take
# the events that never change a job's state: a batch of them is heard in one call; any other event (a job's
# start, its end, its pause) is heard after those reported before it, so that a listener (MQTT) tells a job's
# last progress before its `completed` (the table's state change is heard as the event is booked)
STATELESS_KINDS = frozenset({"step", "progress", "eval", "checkpoint", "prediction"})


class EventsLost(RuntimeError):
    """The service stopped with trainer events that neither the job table nor the file beside it took."""


@dataclass(frozen=True)
class TrainerLost:
    """In a trainer's queue: the trainer died (or was retired) after the events before this one."""

    why: str


QueueItem = TrainerEvent | TrainerLost


class Booking(Protocol):
    """What books the items in the table, inside the intake's transaction (`SchedulerCore`)."""

    def apply_event(self, trainer_id: str, event: TrainerEvent) -> None: ...

    def trainer_lost(self, trainer_id: str, error: str) -> list[str]: ...


class EventIntake:
    def __init__(self, table: JobTable, booking: Booking, state_dir: Path, *,
                 on_events: Callable[[str, list[TrainerEvent]], None] = lambda trainer_id, events: None,
                 on_requeued: Callable[[str], None] = lambda job_id: None,
                 clock: Callable[[], float] = time.monotonic):
        """`on_events(trainer, events)`: hears the events once they are committed, in the order they were
        reported (a job's progress before its `completed`: the events before one that may change a job's
        state are heard before that change), the events between such changes in one call (a trainer's poll
        brings a step's event and one per job; the listeners take lists). `on_requeued(job)`: hears each job
        of a lost trainer queued again, once committed, after the events reported before the loss. `clock`:
        monotonic seconds (the backoff's)."""
        self.table = table
        self.booking = booking
        self.state_dir = Path(state_dir)
        self.on_events = on_events
        self.on_requeued = on_requeued
        self.clock = clock
        self.queues: dict[str, deque[QueueItem]] = {}
        self.retry_at = 0.0          # while the table is locked: when to try again
        self.backoff = TABLE_RETRY_S[0]
        self.refused: str | None = None   # why the table last refused the waiting items (None once it took them)

    def put(self, trainer_id: str, items: Iterable[QueueItem]) -> None:
        self.queues.setdefault(trainer_id, deque()).extend(items)

    def waiting(self, trainer_id: str | None = None) -> int:
        """How many items wait for the table (of one trainer, or of all)."""
        if trainer_id is not None:
            return len(self.queues.get(trainer_id, ()))
        return sum(len(queue) for queue in self.queues.values())

    def apply_all(self) -> bool:
        """Book every trainer's waiting items (one transaction per trainer, in order); False while the table
        refuses them (they stay queued and are tried again after the backoff)."""
        if not any(self.queues.values()):
            return True
        if self.clock() < self.retry_at:
            return False
        for trainer_id, queue in list(self.queues.items()):
            if not queue:
                continue
            try:
                self._apply(trainer_id, queue)
            except JobTableBusy as error:
                self.refused = str(error)
                log.warning("scheduler: %d events of %s wait for the job table: %s; trying again in %.1fs",
                            len(queue), trainer_id, error, self.backoff)
                self.retry_at = self.clock() + self.backoff
                self.backoff = min(self.backoff * 2, TABLE_RETRY_S[1])
                return False
        self.queues = {trainer_id: queue for trainer_id, queue in self.queues.items() if queue}
        self.backoff = TABLE_RETRY_S[0]
        self.refused = None
        return True

    def _apply(self, trainer_id: str, queue: deque[QueueItem]) -> None:
        """One transaction for the trainer's queue; the hooks hear each item once it is committed."""
        batch = list(queue)
        with self.table.transaction():
            booked: list[TrainerEvent] = []   # since the last loss: heard together

            def hear(events: list[TrainerEvent]) -> None:
                if events:
                    self.table.after_commit(lambda: self.on_events(trainer_id, events))

            for item in batch:
                if isinstance(item, TrainerLost) or item.kind not in STATELESS_KINDS:
                    hear(booked)   # what came before is heard before the state change this item may make
                    booked = []
                if isinstance(item, TrainerLost):
                    for job_id in self.booking.trainer_lost(trainer_id, item.why):
                        self.table.after_commit(lambda job_id=job_id: self.on_requeued(job_id))
                    continue
                self.booking.apply_event(trainer_id, item)
                booked.append(item)
            hear(booked)
        for _ in batch:
            queue.popleft()

    def drain(self, timeout_s: float, pause_s: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Try to book everything waiting for up to `timeout_s` (the service stopping), without the backoff
        between tries; whether nothing waits any more."""
        deadline = self.clock() + timeout_s
        while self.waiting() and self.clock() < deadline:
            self.retry_at = 0.0
            if not self.apply_all():
                sleep(pause_s)
        return not self.waiting()

    def spill(self) -> Path | None:
        """Write the events still waiting to the file beside the table (booked at the next start); its path,
        or None when nothing waits; `EventsLost` (logged) where that file cannot be written either. A lost
        trainer is not written: at the next start its jobs are queued again anyway (`SchedulerCore.recover`)."""
        left = [(trainer_id, item) for trainer_id, queue in self.queues.items() for item in queue
                if isinstance(item, TrainerEvent)]
        if not left:
            return None
        try:
            path = spill_events(self.state_dir, left)
        except OSError as error:   # the table's own disk, full or read-only, as likely as not
            spill_file = self.state_dir / UNAPPLIED_EVENTS
            message = (f"{len(left)} trainer events the job table {self.table.path} did not take "
                       f"({self.refused or 'it stayed locked'}) could not be written to {spill_file} "
                       f"either ({error}): they are lost (the jobs' steps, checkpoints and pauses since the table "
                       "last took them); at the next start those jobs resume from the last checkpoint the table "
                       "has. Free space on (or make writable) the state folder's disk before starting the service")
            log.error("scheduler: %s", message)
            raise EventsLost(message) from error
        log.error("scheduler: the job table stayed locked; %d trainer events were written to %s and are applied "
                  "at the next start", len(left), path)
        return path

    def replay(self) -> int:
        """Book the events a previous run spilled (in one transaction), then remove their file; how many."""
        events = read_spilled_events(self.state_dir)
        if events is None:
            return 0
        with self.table.transaction():
            for trainer_id, event in events:
                self.booking.apply_event(trainer_id, event)
        forget_spilled_events(self.state_dir)
        log.info("scheduler: applied %d trainer events left from the last run", len(events))
        return len(events)
