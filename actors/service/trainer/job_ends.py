"""How a job leaves a trainer loop (`JobEnds`, which the loop in trainer_loop.py holds): checkpointed unless it
failed, its adapter written when it is done, its end reported; and, on a pipeline trainer that lost a stage,
every job given back to resume from its last checkpoint (the loop then starts new stages)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from actors.checkpoint import save_checkpoint, saved_step
from actors.checkpoint.peft_io import save_adapter
from actors.engine.generation_eval import MetricError
from actors.engine.kept_best import KeptBest
from actors.service.outputs.job_files import metrics_rows
from actors.service.outputs.remote_outputs import RemoteOutputs
from actors.service.pipeline.pipeline_processes import StageLost
from actors.service.scheduler.job_data import JobUpdate
from actors.service.scheduler.retries import FINAL_WRITE_ATTEMPTS, with_retries
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.trainer_reports import EventKind, TrainerEvents
from actors.storage.base_identity import BaseIdentity

log = logging.getLogger(__name__)


def _kept(metric: str, best: KeptBest | None, last_step: int) -> str:
    """What a keep_best job's end says of the adapter it ends with."""
    if best is None:
        return (f"no evaluation gave a finite {metric.replace('_', ' ')}, so its adapter is its last step's "
                f"(step {last_step})")
    if best.step == last_step:
        return f"its adapter is its last step's ({last_step}), {best.describe()}"
    return f"its adapter is step {best.step}'s, {best.describe()}; its last step's ({last_step}) is in its checkpoint"


def lost_stage_reason(error: StageLost) -> str:
    return (f"its pipeline trainer lost a stage ({error}); the stages were started again and the job resumes "
            "from its last checkpoint")


class JobEnds:
    """A trainer's job ends, over the loop's jobs (`active`, shared with the loop), its step engine, events,
    outputs and the base's identity that adapters record."""

    def __init__(self, trainer_id: str, engine: StepEngine, active: dict[str, ActiveJob], events: TrainerEvents,
                 outputs: RemoteOutputs, base_identity: BaseIdentity):
        self.trainer_id = trainer_id
        self.engine = engine
        self.active = active
        self.events = events
        self.outputs = outputs
        self.base_identity = base_identity
        # what must reach a job's actor before its end (the loop's booked updates: step_booking.py)
        self.before_end: Callable[[str], None] = lambda job_id: None

    def finish(self, active: ActiveJob, kind: EventKind, reason: str, *, retry: bool = False) -> None:
        """Take a job off the trainer: checkpoint it (unless it failed), write its adapter when it is
        done, and report how it ended. `retry`: a `paused` job the scheduler should start again."""
        job, job_id = active.job, active.job_id
        self.before_end(job_id)
        data: dict[str, Any] = {"reason": reason, "tokens": job.tokens_seen}
        lost: StageLost | None = None
        if retry:
            data["retry"] = True
        try:
            if kind in ("completed", "stopped_early"):
                if job.eval_examples and active.last_eval_step != job.step:
                    update = JobUpdate()
                    data["eval_loss"], score = active.evaluate(self.engine, update)
                    if score is not None:
                        data["eval_score"] = score
                    active.assignment.link.update(update)
                    # its last step's row is already written: the rows again, that one with this eval loss
                    rows = metrics_rows([record.as_row() for record in job.history], job.evals, job.scores)
                    self._write(active, "its metrics", lambda: active.files.rewrite(rows))
                best = job.best if job.spec.keep_best is not None else None
                metadata = self.base_identity.adapter_metadata(job_id, job.step if best is None else best.step)
                if job.spec.init_adapter is not None:   # what it started from: the adapter's lineage
                    metadata["init_adapter"] = str(job.spec.init_adapter)
                if job.spec.keep_best is not None:
                    data["reason"] = f"{reason}; {_kept(job.spec.keep_best, best, job.step)}"
                if best is not None:
                    metadata |= {"best": best.facts(), "last_step": job.step}
                    data["best"] = best.facts()
                data["adapter_dir"] = str(self._write(active, "its adapter", lambda: save_adapter(
                    job.adapter, active.local_dir, self.base_identity.serving_id, metadata,
                    None if best is None else best.tensors)))
            if kind != "failed":
                self._write(active, "its checkpoint", lambda: save_checkpoint(
                    job, active.checkpoint_dir, self.base_identity.serving_id, active.reference_file,
                    self.base_identity.adapter_metadata(job_id, job.step)))
                data["checkpoint_step"] = job.step
        except StageLost as error:   # nothing could be read from the stages: it resumes from its last checkpoint
            lost = error
            kind, data = "paused", {"reason": f"{reason}; then {lost_stage_reason(error)}", "retry": True,
                                    "tokens": job.tokens_seen, "checkpoint_step": saved_step(active.checkpoint_dir)}
        except OSError as error:   # the folder refused every try: one clear reason, no false success
            kind, data["reason"] = "failed", (f"{reason}; then writing its results in {active.assignment.output_dir} "
                                              f"failed {FINAL_WRITE_ATTEMPTS} times: {error}; free space there or "
                                              "make it writable, then resume the job")
            data.pop("retry", None)
        except MetricError as error:   # its eval_generate metric (a user's function) refused a prediction
            kind, data["reason"] = "failed", f"{reason}; then its final evaluation failed: {error}"
            data.pop("retry", None)
        except Exception as error:  # writing failed: report it rather than a false success
            log.exception("trainer %s: job %s: writing its results failed", self.trainer_id, job_id)
            kind, data["reason"] = "failed", f"{reason}; then writing its results failed: {error!r}"
            data.pop("retry", None)
        finally:
            del self.active[job_id]
            active.files.close()
            found_lost = self._off_the_engine(job.name)
        if lost is not None:
            active.report_end(self.events, kind, data)
            raise lost
        if active.mirror is not None and kind != "failed":   # reported when its results are uploaded
            self.outputs.leave(active, kind, data)
        else:
            active.report_end(self.events, kind, data)
        if found_lost is not None:   # this job's end stands (its results were written); the others go back
            raise found_lost

    def _off_the_engine(self, name: str) -> StageLost | None:
        """The job taken off the step engine; a pipeline stage found lost only here is returned, not raised:
        raised from `finish`'s `finally`, it skipped the job's end, which the scheduler then never heard of (the
        job stayed "running" on this trainer for ever)."""
        try:
            self.engine.remove_job(name)
        except StageLost as error:
            return error
        return None

    def give_back_all(self, error: StageLost) -> None:
        """A pipeline's stage was lost: every job here goes back to the scheduler (paused, to be started again
        from its last checkpoint: nothing can be read from the stages any more)."""
        log.error("trainer %s: %s", self.trainer_id, error)
        for active in list(self.active.values()):
            del self.active[active.job_id]
            active.files.close()
            self.engine.remove_job(active.job.name)
            active.report_end(self.events, "paused", {"reason": lost_stage_reason(error), "retry": True,
                                                      "tokens": active.job.tokens_seen,
                                                      "checkpoint_step": saved_step(active.checkpoint_dir)})

    @staticmethod
    def _write(active: ActiveJob, what: str, write: Any) -> Any:
        """`write()` with a few tries (a full disk may free up), each failure counted against the job's
        folder; the last OSError is raised."""
        return with_retries(write, on_failure=lambda error, _tries, _last: active.files.failed_write(error, what))
