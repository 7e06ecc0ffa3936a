"""A trainer's waits on each job's next micro-batch and on the verdicts of its stop rule (the job actor's): a
job whose data or verdict is late is waited for briefly, then left out of the steps while the other jobs go
on, and after `data_timeout_s` checkpointed and given back to the scheduler; a verdict that stops a job ends
it before its next step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.feed import JobLinkLost
from actors.service.trainer.trainer_reports import TrainerEvents

log = logging.getLogger(__name__)


@dataclass
class JobWaits:
    trainer_id: str
    config: TrainerConfig
    events: TrainerEvents
    active: dict[str, ActiveJob]                 # the trainer loop's jobs (the same dict)
    finish: Callable[..., None]                  # the loop's end of a job: (active, kind, reason, retry=...)

    def data_arrived(self, active: ActiveJob, deadline: float) -> bool:
        """Whether the job's next micro-batch is here. A job whose data is late is waited for until
        `deadline` (shared by all jobs of this step) the first time, then left out of the steps without
        waiting; after `data_timeout_s` it is given back to the scheduler (checkpointed first)."""
        job = active.job
        if job.pending is not None or job.done:
            return True
        now = time.monotonic()
        wait = 0.0 if active.stalled_since is not None else max(deadline - now, 0.0)
        verdicts_here = self._verdicts_due_here(active, wait)
        if self.active.get(active.job_id) is not active:
            return False   # a verdict just stopped it (or its job actor was lost)
        if verdicts_here and active.feed.ready(
                0.0 if active.stalled_since is not None else max(deadline - time.monotonic(), 0.0)):
            if active.stalled_since is not None:
                log.info("trainer %s: job %s: its data arrived again after %.1fs", self.trainer_id,
                         active.job_id, now - active.stalled_since)
            active.stalled_since = None
            return True
        if active.stalled_since is None:
            active.stalled_since = now
            log.warning("trainer %s: job %s: its data or stop verdict is late (waited up to %gs); its steps wait, "
                        "the other jobs go on", self.trainer_id, active.job_id, self.config.data_grace_s)
        elif now - active.stalled_since >= self.config.data_timeout_s:
            self.give_back(active, f"its data did not arrive for {now - active.stalled_since:.0f}s "
                                    f"(data_timeout_s={self.config.data_timeout_s:g}; its job actor hung?)")
        return False

    def _verdicts_due_here(self, active: ActiveJob, timeout: float) -> bool:
        """Whether the verdicts the job's next step must follow (`VERDICT_LAG`) are here (waiting up to
        `timeout`); applied at once when they are, so that a stop ends the job before that step."""
        if not active.verdicts.arrived(active.job.step, timeout):
            return False
        self.apply_verdicts(active)
        return True

    def apply_verdicts(self, active: ActiveJob) -> None:
        """Apply the job's verdicts that are due (`VERDICT_LAG`) and here, in step order; a stop ends it."""
        while True:
            try:
                verdict = active.verdicts.next_due(active.job.step)
            except JobLinkLost as error:   # its job actor died: its stop rule and data with it
                self.give_back(active, f"its job actor was lost ({error})")
                return
            if verdict is None:
                return
            if verdict.predicted_stop_step is not None:
                self.events.emit("prediction", active.job_id, active.job.step,
                                 predicted_stop_step=verdict.predicted_stop_step)
            if verdict.stop is not None:
                self.finish(active, "stopped_early", verdict.stop.reason)
                return

    def give_back(self, active: ActiveJob, reason: str) -> None:
        """Checkpoint a job whose link to its data failed and hand it back to the scheduler, which starts
        it again with a new job actor (or fails it after a few such tries)."""
        log.warning("trainer %s: job %s: %s; checkpointing it and giving it back", self.trainer_id,
                    active.job_id, reason)
        self.finish(active, "paused", reason, retry=True)
