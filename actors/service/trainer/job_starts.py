"""The jobs assigned to a trainer loop started at a step boundary (`JobStarts`, which the loop in
trainer_loop.py holds): one whose last upload here still runs waits for it (deferred to a later boundary), a
second assignment of a running job is ignored, a pipeline that lost a stage gets new stages first, and a job
that cannot start fails alone with the reason (or, when a stage was lost meanwhile, goes back to start again).
Each start itself (feed, folder, adapter, checkpoint, tracking): job_attach.py. The trackers of the jobs
started here are kept until they finish writing, so that a closing trainer can wait for them."""

from __future__ import annotations

import logging
import time

from actors.checkpoint import DataChanged
from actors.service.outputs.remote_outputs import RemoteOutputs
from actors.service.outputs.tracking import JobTracker
from actors.service.pipeline.pipeline_processes import StageLost
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.job_attach import start_job, start_tracking
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.loop_steps import LoopSteps
from actors.service.trainer.trainer_commands import Commands
from actors.service.trainer.trainer_reports import TrainerEvents
from actors.spec.saved_adapter import AdapterFileError
from actors.storage.storage_errors import StorageUnreachable

log = logging.getLogger(__name__)


class JobStarts:
    """Starts of the loop's jobs (`active`, shared with the loop) on its steps' engine."""

    def __init__(self, trainer_id: str, steps: LoopSteps, active: dict[str, ActiveJob], events: TrainerEvents,
                 outputs: RemoteOutputs, commands: Commands, prefetch: int):
        self.trainer_id = trainer_id
        self.steps = steps
        self.active = active
        self.events = events
        self.outputs = outputs
        self.commands = commands   # where a start that must wait is deferred to the next boundary
        self.prefetch = prefetch
        self.trackers: list[JobTracker] = []   # trackers still writing (waited for at close)

    def start_all(self, assignments: list[Assignment]) -> None:
        """Start each; where a pipeline's stage is found lost while one starts (that one is given back), the
        ones after it wait for the new stages (deferred to the next boundary) rather than being dropped."""
        for index, assignment in enumerate(assignments):
            try:
                self.start(assignment)
            except StageLost:
                self.commands.deferred.extend(assignments[index + 1:])
                raise

    def start(self, assignment: Assignment) -> None:
        job_id, engine = assignment.job_id, self.steps.engine
        if job_id in self.outputs.leaving:   # its end waits for its upload (bounded): it starts again after that
            log.info("trainer %s: job %s starts once its last upload here ended", self.trainer_id, job_id)
            self.commands.deferred.append(assignment)
            return
        if job_id in self.active:
            log.warning("trainer %s: job %s is already running here; ignoring the second assignment",
                        self.trainer_id, job_id)
            return
        if engine.lost is not None:   # a pipeline's lost stage: its stages first
            failed = self.steps.restart_stages()
            if failed is not None:
                self.events.emit("paused", job_id, 0, reason=f"it could not start: {failed}", retry=True)
                return
        refusal = self.steps.admission.sampling_refusal(assignment.submission.job)
        if refusal is not None:
            log.error("trainer %s: job %s could not start: %s", self.trainer_id, job_id, refusal)
            self.events.emit("failed", job_id, 0, reason=f"could not start: {refusal}")
            return
        try:
            start = start_job(assignment, engine, self.outputs, self.trainer_id, prefetch=self.prefetch,
                              base_model_name=self.steps.booking.base_identity.serving_id)
        except StageLost as error:   # not the job's fault: it goes back and starts again on the new stages
            self.events.emit("paused", job_id, 0, reason=f"it could not start: {error}", retry=True)
            raise
        except StorageUnreachable as error:   # its saved adapter's store did not answer: started again (bounded)
            log.warning("trainer %s: job %s could not start: %s", self.trainer_id, job_id, error)
            self.events.emit("paused", job_id, 0, reason=f"it could not start: {error}", retry=True)
            return
        except Exception as error:  # a job that cannot start fails alone
            if isinstance(error, (DataChanged, AdapterFileError)):   # the user's to act on: the message says what
                log.error("trainer %s: job %s could not start: %s", self.trainer_id, job_id, error)
            else:
                log.exception("trainer %s: job %s could not start", self.trainer_id, job_id)
            self.events.emit("failed", job_id, 0, reason=f"could not start: {error}")
            return
        active, job = start.active, start.active.job
        active.tracker = start_tracking(assignment, active.local_dir, start.resumed_from, self.trainer_id)
        if active.tracker is not None:
            self.trackers = [t for t in self.trackers if not t.done.is_set()] + [active.tracker]
        if start.resume_verdict is not None:
            # the stop decisions of its last steps before the checkpoint, made again from the restored history
            # (a pause may have cut them off): due like step k - 1's verdict; a stop decided at step k waits
            # for its own turn (`StopVerdicts.next_due`), so the job stops where an unpaused one does
            active.verdicts.expect(job.step - 1, start.resume_verdict)
        self.active[job_id] = active
        resumed = start.resumed_from is not None
        history = [record.as_row() for record in job.history] if resumed else []
        evals = [[step, loss] for step, loss in job.evals] if resumed else []
        self.events.emit("started", job_id, job.step, resumed_from=start.resumed_from, total_steps=job.total_steps,
                         trainer=self.trainer_id, history=history, evals=evals, tokens=job.tokens_seen,
                         checkpoint_note=start.note, **active.best_facts())

    def wait_for_trackers(self, seconds: float) -> None:
        """The last metrics and artefacts of the jobs that left, written within `seconds` in all (each one
        that is not, logged: its last metrics or adapter artefact may be missing)."""
        deadline = time.monotonic() + seconds
        for tracker in self.trackers:
            if not tracker.wait(max(deadline - time.monotonic(), 0.0)):
                log.warning("trainer %s: job %s: its tracking did not finish writing within %.0fs; its last metrics "
                            "or its adapter artefact may be missing there", self.trainer_id, tracker.job_id,
                            seconds)
