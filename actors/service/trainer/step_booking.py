"""What a trainer loop books after each fused step (`StepBooking`, held by the loop in trainer_loop.py): the
step's row in the step log and its totals, and each job's optimizer step: its progress event and tracking, its
evaluation when one is due, its metrics row, its periodic checkpoint, and the update that asks its stop rule
for a verdict.

The updates are sent while the next step runs (`send_updates_meanwhile`, which the loop hands to the engine's
`run_step`): on Ray each is a call to the job's actor (0.3-0.7 ms of the trainer's host time on a 2-core CPU),
32 jobs' calls 10-20 ms a step in which a GPU would stand idle between steps; sent once the next step's kernels
are queued, they cost the GPU nothing. The verdicts keep their timing (stop_verdicts.py: the verdict on step k
is due before the job's step k + 2, so it has the whole of step k + 1 to come). Whatever needs them sent first
sends them itself (`send_updates`): a job's end (its job actor hears the last update before the end), a step
that does not come (the loop idles), the next booking."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.checkpoint import save_checkpoint
from actors.engine.generation_eval import MetricError
from actors.engine.step_report import StepReport
from actors.service.outputs.job_files import CHECKPOINT_FOLDER
from actors.service.outputs.remote_outputs import RemoteOutputs
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobUpdate
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.step_log import StepLog, StepTotals
from actors.service.trainer.trainer_reports import TrainerEvents
from actors.storage.base_identity import BaseIdentity

log = logging.getLogger(__name__)


@dataclass
class StepBooking:
    """A trainer's steps booked, over the loop's jobs (`active`, shared with the loop), its step engine, step
    log, totals, events, outputs and the base's identity that checkpoints record."""

    trainer_id: str
    config: TrainerConfig
    engine: StepEngine
    active: dict[str, ActiveJob]                 # the trainer loop's jobs (the same dict)
    events: TrainerEvents
    outputs: RemoteOutputs
    base_identity: BaseIdentity
    step_log: StepLog
    totals: StepTotals                           # the loop's (its status reports them)
    finish: Callable[..., None]                  # the loop's end of a job: (active, kind, reason)
    # each job's real tokens in the last fused step (the loop's status), replaced (not mutated) by the loop thread
    last_step_job_tokens: dict[str, int] = field(default_factory=dict)
    # the jobs' updates booked and not yet sent, in step order: (the job, its optimizer step, the update)
    unsent: list[tuple[ActiveJob, int, JobUpdate]] = field(default_factory=list)

    def after_step(self, report: StepReport, predicted: int, predicted_resident: int | None,
                   adapter_parameters: int, call_job_tokens: dict[str, int] | None = None) -> None:
        """Book the fused step just run (`predicted`, `predicted_resident`: the memory model's forecasts of
        its peaks, in its step log row; `call_job_tokens`: the tokens of interactive models' calls that shared
        it, by their jobs, accounted beside the step's jobs')."""
        self.send_updates()   # any the last step did not send (an engine that runs no work meanwhile)
        self.totals.add(report)
        row = {"trainer": self.trainer_id, "time": round(time.time(), 3), **report.as_row(),
               # the allocator's peak (what the memory model learns), and on a CPU the resident set's (admitted by)
               "predicted_memory_bytes": predicted, "predicted_resident_bytes": predicted_resident,
               "adapter_parameters": adapter_parameters,
               "sequence_lengths": report.sequence_lengths,
               # what each user is accounted (actors/service/events/event_booking.py): each job's real tokens of the
               # step, and the GPUs the step ran on (its stages on CUDA; none on a CPU)
               "job_tokens": {**{result.job: result.tokens for result in report.results}, **(call_job_tokens or {})},
               "gpus": self.config.stages if self.engine.base.device.type == "cuda" else 0}
        self.step_log.write(row)
        self.last_step_job_tokens = dict(row["job_tokens"])   # after its row is in the step log
        self.events.emit("step", "", report.step, **row)
        now = time.time()
        for result in report.results:
            active = self.active[result.job]
            record = result.optimizer_step
            if record is None:
                continue
            job = active.job
            update = JobUpdate(steps=[record.as_row()])
            row = record.as_row()   # its metrics.jsonl row, written once the step's evaluation (if any) is done
            seconds = max(now - active.last_step_time, 1e-9)
            active.last_step_time = now
            self.events.emit("progress", result.job, record.step, **record.as_row(),
                             tokens_per_s=record.tokens / seconds, total_steps=job.total_steps)
            if active.tracker is not None:
                active.tracker.step(record.as_row(), record.tokens / seconds)
            spec = job.spec
            if job.eval_examples and spec.eval_every and record.step % spec.eval_every == 0:
                try:
                    eval_loss, score = active.evaluate(self.engine, update)
                except MetricError as error:   # a user's metric function: that job fails, the others go on
                    self.finish(active, "failed", f"evaluation after step {record.step} failed: {error}")
                    continue
                self.events.emit("eval", result.job, record.step, eval_loss=eval_loss, eval_score=score,
                                 **active.best_facts())
                row["eval_loss"] = eval_loss
                if score is not None:
                    row["eval_score"] = score
            active.files.append(row)
            if self._checkpoint_due(active, record.step) and not job.done:
                self._checkpoint(active)
            self.unsent.append((active, record.step, update))
            if active.files.failed:
                self.finish(active, "failed", active.files.failed)

    def send_updates(self, job_id: str | None = None) -> None:
        """Send the booked updates (`job_id`'s only, where given), in step order, each verdict expected. Raises
        what a link raised (that update and the others not yet sent stay, in order, for the next try)."""
        mine = [entry for entry in self.unsent if job_id is None or entry[0].job_id == job_id]
        for entry in mine:
            active, step, update = entry
            active.verdicts.expect(step, active.assignment.link.update(update))
            del self.unsent[next(index for index, kept in enumerate(self.unsent) if kept is entry)]

    def send_updates_meanwhile(self) -> None:
        """`send_updates` while the device runs the next step (the engine calls it once the step's kernels are
        queued): never raises into the step; a link that raised is tried again after it (`after_step` or a
        job's end), where its error takes its usual course."""
        try:
            self.send_updates()
        except Exception as error:  # noqa: BLE001 - retried after the step, where it raises
            log.warning("trainer %s: a job's update could not be sent during the step (%r); tried again after it",
                        self.trainer_id, error)

    def _checkpoint_due(self, active: ActiveJob, step: int) -> bool:
        every_s = active.job.spec.checkpoint_every_s
        return (step % active.job.spec.checkpoint_every == 0
                or (every_s is not None and time.monotonic() - active.last_checkpoint >= every_s))

    def _checkpoint(self, active: ActiveJob) -> None:
        """A periodic checkpoint; a failed write is counted against the job's folder and tried again at its
        next step (the previous checkpoint stays in place meanwhile)."""
        job = active.job
        try:
            save_checkpoint(job, active.checkpoint_dir, self.base_identity.serving_id, active.reference_file,
                            self.base_identity.adapter_metadata(active.job_id, job.step))
        except OSError as error:
            active.files.failed_write(error, CHECKPOINT_FOLDER)
            return
        active.files.succeeded(CHECKPOINT_FOLDER)
        active.last_checkpoint = time.monotonic()
        if active.mirror is None:
            self.events.emit("checkpoint", active.job_id, job.step)
            return
        self.outputs.checkpoint_saved(active, job.step)   # uploaded in the background; its event when that ends
