"""A job's start on a trainer: its feed, its folder (staging and mirror for a storage URI), its adapter
attached, its newest checkpoint restored (else its `init_adapter` loaded), its reference adapter held (and a copy kept
in its folder for its checkpoints), its files and tracking opened. A URI's checkpoint is fetched first."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from actors.checkpoint import CheckpointError, has_checkpoint, load_checkpoint
from actors.checkpoint.initial_adapter import start_from_adapter, start_from_tensors
from actors.checkpoint.peft_io import save_adapter
from actors.engine.adapter_surgery import AdapterHandle
from actors.engine.job import TrainingJob
from actors.engine.trainer import FusedTrainer
from actors.service.outputs.job_files import (
    CHECKPOINT_FOLDER,
    REFERENCE_FOLDER,
    JobFiles,
    metrics_rows,
    unwritable_folder,
)
from actors.service.outputs.remote_outputs import RemoteOutputs
from actors.service.outputs.tracking import JobTracker, start_tracker
from actors.service.scheduler.job_data import JobUpdate
from actors.service.trainer.active_job import ActiveJob, JobMirror
from actors.service.trainer.feed import MicroBatchFeed, Pending
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.stop_verdicts import StopVerdicts
from actors.spec.job_spec import JobSpec, continued_steps
from actors.storage.storage_uri import is_uri
from policies.stopping import Verdict

if TYPE_CHECKING:
    from actors.service.pipeline.pipeline_engine import PipelineEngine

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StartedJob:
    """A job on the trainer's steps from now on, and how it started."""

    active: ActiveJob
    resumed_from: int | None           # the step of the checkpoint it resumed from (0: none was usable)
    note: str                          # what its start skipped or chose, for its reason ("" when nothing)
    resume_verdict: Pending[Verdict] | None   # its job actor's verdict on its history as of that checkpoint


def start_job(assignment: Assignment, trainer: FusedTrainer | PipelineEngine, outputs: RemoteOutputs,
              trainer_id: str, *, prefetch: int, base_model_name: str) -> StartedJob:
    """Attach the job to `trainer`, restored from its newest checkpoint where it has one. Raises whatever kept
    it from starting (its folder or store refusing writes, its store unreadable, ...): nothing of it is left
    on the trainer then. `trainer`: one device's, or a pipeline's (`PipelineEngine`). `base_model_name`: what
    the adapters it writes name as their base (`base_model_name_or_path`)."""
    job_id = assignment.job_id
    submission = assignment.submission
    spec = submission.job.model_copy(update={"name": job_id})
    feed = MicroBatchFeed(assignment.link.fetch, assignment.data.start, prefetch=prefetch)
    mirror: JobMirror | None = None
    local_dir = Path(assignment.output_dir)
    if is_uri(assignment.output_dir):
        local_dir = outputs.staging_folder(job_id)
    files = JobFiles(job_id, local_dir)
    job = None
    note = ""
    try:
        if is_uri(assignment.output_dir):
            mirror = outputs.mirror(assignment.output_dir, local_dir)
        job = trainer.attach(spec, feed, assignment.eval_examples, assignment.data.total_steps, seed=submission.seed)
        job.data_digest = assignment.data.digest   # checked against its checkpoint's (DataChanged), saved with it
        folder = local_dir / CHECKPOINT_FOLDER
        resumed_from = None
        resume_verdict = None
        kept_reference = None   # its reference adapter's tensors, as its checkpoint kept them
        fetch_note = outputs.fetch_checkpoint(mirror, folder) if mirror is not None else ""
        if has_checkpoint(folder):
            resumed_from, note, kept_reference = resume(job, folder, f"trainer {trainer_id}: job {job_id}")
            if resumed_from:   # at its data's old end, its epochs raised: on to the new end from there, its next
                # accumulation begun afresh even where the new end is what a job given the epochs at once plans
                continued = continued_steps(spec, assignment.data.train_examples, job.step, job.data_position())
                if continued is not None:
                    job.plan_to(continued)
            trainer.restored(job)   # a pipeline's stages take what was loaded (or the job as it was)
            if resumed_from is not None:   # the job's loss history as of its checkpoint, and its verdict
                resume_verdict = assignment.link.update(JobUpdate(
                    resumed_from=resumed_from, steps=[r.as_row() for r in job.history], evals=list(job.evals),
                    scores=list(job.scores), total_steps=job.total_steps))
        if not resumed_from and spec.init_adapter is not None:   # no checkpoint of its own: the saved adapter
            started = start_from_adapter(job.adapter, spec.init_adapter)
            trainer.restored(job)
            note = "; ".join(part for part in (note, started) if part)
        if spec.reference_adapter:   # its reference model: the saved adapter, frozen (resumed: its checkpoint's copy)
            held = hold_reference(trainer, job, spec, kept_reference, local_dir / REFERENCE_FOLDER, base_model_name)
            note = "; ".join(part for part in (note, held) if part)
        try:
            files.start(metrics_rows([record.as_row() for record in job.history], job.evals, job.scores), job.step)
        except OSError as error:
            raise unwritable_folder(files.folder, assignment.output_dir, error) from error
        feed.prime()
        trainer.add_job(job)
    except Exception:   # nothing of the job stays on the trainer; the caller reports why
        if job is not None:
            trainer.discard(job_id)
        files.close()
        raise
    note = "; ".join(part for part in (fetch_note, note) if part)
    active = ActiveJob(assignment=assignment, job=job, feed=feed, files=files, local_dir=local_dir, mirror=mirror,
                       verdicts=StopVerdicts(f"trainer {trainer_id}: job {job_id}"))
    return StartedJob(active=active, resumed_from=resumed_from, note=note, resume_verdict=resume_verdict)


def resume(job: TrainingJob, folder: Path, label: str) -> tuple[int | None, str, dict | None]:
    """Restore the job from its newest valid checkpoint: (its step, a note on what was skipped, its reference
    adapter's tensors where the checkpoint kept them), or (0, why, None) when none is valid (the job starts over,
    and says so). `label`: whose, for the log."""
    try:
        loaded = load_checkpoint(job, folder)
    except CheckpointError as error:
        log.error("%s: no usable checkpoint, it starts over: %s", label, error)
        return 0, f"no usable checkpoint, started over: {error}", None
    note = ""
    if loaded.skipped:
        note = f"resumed from the previous checkpoint; skipped: {'; '.join(loaded.skipped)}"
        log.warning("%s: %s", label, note)
    return job.step, "; ".join([*([note] if note else []), *loaded.notes]), loaded.reference


def hold_reference(trainer: FusedTrainer | PipelineEngine, job: TrainingJob, spec: JobSpec, kept: dict | None,
                   folder: Path, base_model_name: str) -> str:
    """The job's reference adapter on `trainer`: its checkpoint's copy (`kept`) where it resumed from one that has
    it, else its init_adapter (read and checked again); written to `folder` (a PEFT folder in the job's own) from
    which each checkpoint takes it, so that a resumed job needs neither the init_adapter's folder nor this one.
    Returns the note for its start."""
    def load(handle: AdapterHandle) -> None:
        if kept is not None:
            start_from_tensors(handle, kept, f"the reference adapter in its checkpoint (from {spec.init_adapter})")
        else:
            start_from_adapter(handle, spec.init_adapter)
        try:
            save_adapter(handle, folder, base_model_name, {"reference_of": spec.name,
                                                           "init_adapter": str(spec.init_adapter)})
        except OSError as error:
            raise OSError(f"cannot keep a copy of its reference adapter in {folder}: {error}; make the folder "
                          "writable (or free space there) and resume the job") from error

    trainer.hold_reference(job, load)
    if kept is not None:
        return f"its reference is its checkpoint's copy of {spec.init_adapter}"
    return f"its reference is {spec.init_adapter}"


def start_tracking(assignment: Assignment, local_dir: Path, resumed_from: int | None,
                   trainer_id: str) -> JobTracker | None:
    """The job's tracking (actors/service/outputs/tracking.py), or None; never raises (tracking never stops a job)."""
    try:
        return start_tracker(assignment.job_id, assignment.submission, local_dir,
                             str(assignment.output_dir) if is_uri(assignment.output_dir) else None, resumed_from)
    except Exception:  # e.g. no thread could be started: the job trains without tracking
        log.exception("trainer %s: job %s: its tracking could not start; it trains without it", trainer_id,
                      assignment.job_id)
        return None
