"""Jobs the table says run on a trainer that no longer holds them: given back, to resume from their checkpoints.

A trainer reports every job's end (completed, failed, paused, given back) as an event, and lists the jobs it holds
(training, or uploading their last results) in its status. It reads that status before it hands over its events,
and takes a job off the list only after reporting its end, so once the scheduler has booked every event it
received, a job still "running" on a trainer whose latest status no longer lists it has lost its end report: a
bug in the trainer (one such, a pipeline stage found lost as a finished job left, kept a job "running" for ever
until fixed). Left alone, that job never ends and its user waits for ever; here it is given back like a job
whose job actor was lost: queued again, from its last checkpoint, a bounded number of times
(`EventBooking.given_back`), with an error in the log that says what happened.

Only a job the trainer has listed (this incarnation of it) counts: a job assigned but not yet picked up at the
trainer's next step boundary is not listed yet. Interactive models leave their trainer through their front, not
by an event, and are left out. The miss must be seen in `MISSED_POLLS` of the trainer's answers in a row."""

from __future__ import annotations

import logging
from collections.abc import Callable

from actors.service.events.event_booking import EventBooking
from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerStatus

log = logging.getLogger(__name__)

MISSED_POLLS = 2   # one is decisive by the ordering above; a second answer in a row costs a tick, not a job


class HeldJobs:
    """Which running jobs each trainer has listed, and for how many of its answers in a row one went missing."""

    def __init__(self) -> None:
        self.listed_by: dict[str, tuple[str, str]] = {}                  # job -> (trainer, incarnation) that listed it
        self.missing: dict[str, tuple[int, TrainerStatus]] = {}           # job -> (answers missing it, the last one)

    def unheld(self, statuses: dict[str, TrainerStatus], running: list[JobRecord],
               skip: Callable[[str], bool]) -> list[JobRecord]:
        """The running jobs (`running`: the table's, every event received booked) whose trainer listed them and
        has not in its last `MISSED_POLLS` answers (`statuses`: each trainer's latest); `skip`: jobs on their
        way to a trainer, interactive models."""
        unheld = []
        for record in running:
            status = statuses.get(record.trainer or "")
            if status is None or skip(record.id):
                self.missing.pop(record.id, None)
                continue
            holder = (status.trainer_id, status.incarnation)
            if record.id in status.jobs:
                self.listed_by[record.id] = holder
                self.missing.pop(record.id, None)
                continue
            if self.listed_by.get(record.id) != holder:   # not picked up yet (or listed by another incarnation)
                continue
            count, seen = self.missing.get(record.id, (0, None))
            if seen is not status:   # a new answer of the trainer's
                count += 1
            self.missing[record.id] = (count, status)
            if count >= MISSED_POLLS:
                unheld.append(record)
        # a job that stopped running forgets its trainer: started again (even there), it must be listed anew
        running_ids = {record.id for record in running}
        for job_id in [j for j in self.listed_by if j not in running_ids]:
            self.forget(job_id)
        return unheld

    def forget(self, job_id: str) -> None:
        self.listed_by.pop(job_id, None)
        self.missing.pop(job_id, None)


def give_back_unheld(held: HeldJobs, booking: EventBooking, statuses: list[TrainerStatus],
                     skip: Callable[[str], bool]) -> list[str]:
    """Each running job of the table (`booking.table`) that its trainer stopped holding, booked as given back in
    one transaction (none opened where there is none); their ids. `statuses`: each trainer's latest."""
    running = booking.table.all(("running",))
    unheld = held.unheld({status.trainer_id: status for status in statuses}, running, skip) if running else []
    if unheld:
        with booking.table.transaction():
            _book(held, booking, unheld)
    return [record.id for record in unheld]


def _book(held: HeldJobs, booking: EventBooking, unheld: list[JobRecord]) -> None:
    for record in unheld:
        log.error("scheduler: job %s runs on %s by the job table, but %s no longer holds it and reported no end "
                  "(a trainer bug: please report it with the trainer's log); it is queued again from its last "
                  "checkpoint", record.id, record.trainer, record.trainer)
        booking.given_back(record.id, {"reason": f"its trainer {record.trainer} stopped holding it without "
                                                 "reporting its end", "checkpoint_step": record.checkpoint_step})
        booking.table.after_commit(lambda job_id=record.id: held.forget(job_id))
