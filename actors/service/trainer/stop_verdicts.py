"""A job's stop verdicts on their way from its job actor, and when each takes effect (`VERDICT_LAG`): the
trainer's side of the protocol that makes the step a job stops at depend on its losses alone."""

from __future__ import annotations

import logging

from actors.service.trainer.feed import Done, JobLinkLost, Pending, wait_for
from policies.stopping import Verdict

log = logging.getLogger(__name__)

VERDICT_LAG = 2
"""A job's stop verdict for optimizer step k (its job actor's answer to that step's update) takes effect after
step k + VERDICT_LAG - 1, however early or late it arrives: before the job's step k + VERDICT_LAG starts, the
trainer has that answer (waiting for it like for late data) and applies the verdicts up to it, never one after
it. So the step a job stops at depends on its losses alone, not on how busy its job actor was; the answer has
a whole step's time to arrive. On resume, the job's data makes the stop decisions of its last VERDICT_LAG
steps again (actors/service/scheduler/job_data.py)."""


class StopVerdicts:
    """The answers to a job's updates in step order, each a `Verdict` on its way: `arrived` says whether the
    ones the job's next step must follow are here (waiting a while for them), `next_due` hands out those that
    are due and here, one at a time, in step order (one not yet here holds back those after it)."""

    def __init__(self, label: str):
        self.label = label   # whose verdicts, for the log: "trainer t: job j"
        self.waiting: list[tuple[int, Pending[Verdict]]] = []   # (the step it answers, its verdict)

    def expect(self, step: int, verdict: Pending[Verdict]) -> None:
        """The verdict on the job's history through optimizer step `step` (steps come in order)."""
        self.waiting.append((step, verdict))

    @staticmethod
    def due_through(job_step: int) -> int:
        """The last step whose verdict the job's next step (after `job_step`) must follow."""
        return job_step + 1 - VERDICT_LAG

    def arrived(self, job_step: int, timeout: float) -> bool:
        """Whether every verdict due before the job's next step is here, waiting up to `timeout` seconds."""
        due_through = self.due_through(job_step)
        return all(wait_for(pending, timeout) for step, pending in self.waiting if step <= due_through)

    def next_due(self, job_step: int) -> Verdict | None:
        """The first verdict that is due and here, taken off the queue; None when there is none (or the first
        one is not here yet). An update that was lost is logged and skipped; a resumed job's stop for a later
        step waits for that step's turn. Raises JobLinkLost: the job actor died (its stop rule with it)."""
        while self.waiting:
            step, pending = self.waiting[0]
            if step > self.due_through(job_step) or not pending.done():
                return None
            del self.waiting[0]
            try:
                verdict = pending.result()
            except JobLinkLost:
                raise
            except Exception as error:  # noqa: BLE001 - losing a job's history must not stop training
                log.warning("%s: its loss update was lost: %r", self.label, error)
                continue
            if verdict.stop is not None and verdict.stop.step > step:
                self.waiting.insert(0, (verdict.stop.step, Done(verdict)))   # a resumed job's stop, for later
                return None
            return verdict
        return None
