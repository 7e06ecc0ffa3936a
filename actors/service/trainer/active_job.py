"""What a trainer holds for each job it trains: `ActiveJob` from the job's start to its end, and `JobMirror`,
its mirroring to a storage URI. (How a job starts: job_attach.py; the mirroring itself: outputs/remote_outputs.py.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.checkpoint.peft_io import adapter_state_dict
from actors.checkpoint.peft_names import WEIGHTS_NAME
from actors.engine.job import TrainingJob
from actors.engine.kept_best import KeptBest, improves
from actors.service.outputs.job_files import CHECKPOINT_FOLDER, REFERENCE_FOLDER, JobFiles
from actors.service.outputs.tracking import JobTracker
from actors.service.scheduler.job_data import JobUpdate
from actors.service.trainer.feed import MicroBatchFeed
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.stop_verdicts import StopVerdicts
from actors.service.trainer.trainer_reports import EventKind, TrainerEvents
from actors.storage.storage_location import StorageLocation


@dataclass(kw_only=True)
class JobMirror:
    """A job whose output_dir is a storage URI (`remote`): written to a node-local staging folder
    (`local_dir`), each complete checkpoint then uploaded in the background, one upload at a time."""

    remote: StorageLocation
    local_dir: Path
    checkpoint_step: int = 0             # the step of its newest checkpoint on this node
    upload: Future | None = None         # its periodic checkpoint's upload in the background, while it runs
    upload_step: int = 0                 # the step of that checkpoint
    upload_due: bool = False             # a newer checkpoint waits for that upload to end
    upload_error: str | None = None      # why its last checkpoint upload failed, until one succeeds
    abandoned: threading.Event = field(default_factory=threading.Event)   # set: its uploads write no pointer


@dataclass(kw_only=True)
class ActiveJob:
    """A job on the trainer's steps: its training state, data feed, files and stop verdicts."""

    assignment: Assignment
    job: TrainingJob
    feed: MicroBatchFeed
    files: JobFiles
    local_dir: Path                      # where its files are written: output_dir, or a staging folder
    mirror: JobMirror | None             # where output_dir is a storage URI
    verdicts: StopVerdicts
    tracker: JobTracker | None = None    # its TensorBoard / MLflow tracking (`tracking:` of its spec)
    last_step_time: float = field(default_factory=time.time)
    last_eval_step: int = -1
    last_checkpoint: float = field(default_factory=time.monotonic)
    stalled_since: float | None = None   # when its data was first late (monotonic), while it is

    @property
    def job_id(self) -> str:
        return self.assignment.job_id

    @property
    def checkpoint_dir(self) -> Path:
        return self.local_dir / CHECKPOINT_FOLDER

    @property
    def reference_file(self) -> Path | None:
        """Its reference adapter's weights, copied into its folder when it started (each checkpoint takes them
        along), where it holds one."""
        return self.local_dir / REFERENCE_FOLDER / WEIGHTS_NAME if self.job.spec.reference_adapter else None

    def evaluate(self, engine: StepEngine, update: JobUpdate) -> tuple[float, float | None]:
        """Evaluate the job after its last step: its eval loss and, with eval_generate, its generation score;
        both booked with the job (checkpointed: a resumed job's stop rule sees them), in `update` and with
        its tracker; with keep_best, the adapter kept where this evaluation is its best."""
        job = self.job
        eval_loss = engine.evaluate(job)
        job.evals.append((job.step, eval_loss))
        update.evals.append((job.step, eval_loss))
        score = None
        if job.spec.eval_generate is not None:
            evaluation = engine.evaluate_generation([job])[0]
            score = evaluation.score
            self.files.append_generations(job.step, evaluation.samples)   # what it wrote, beside the score
            job.scores.append((job.step, score))
            update.scores.append((job.step, score))
        self.last_eval_step = job.step
        metric = job.spec.keep_best
        if metric is not None:   # its adapter now, on the host, where this evaluation is its best so far
            value = eval_loss if metric == "eval_loss" else score
            if improves(metric, value, job.best):
                job.best = KeptBest(metric, job.step, float(value), adapter_state_dict(job.adapter))
        if self.tracker is not None:
            self.tracker.eval(job.step, eval_loss, score)
        return eval_loss, score

    def best_facts(self) -> dict[str, Any]:
        """`best`: a keep_best job's best evaluation so far (metric, step, value) for its events, which the job
        table's record shows; {} where it has none."""
        best = self.job.best if self.job.spec.keep_best is not None else None
        return {} if best is None else {"best": best.facts()}

    def report_end(self, events: TrainerEvents, kind: EventKind, data: dict[str, Any]) -> None:
        """Report how the job ended (its tracking finished first, its problems added to its reason)."""
        if self.tracker is not None:
            adapter_written = kind in ("completed", "stopped_early")
            self.tracker.finish(kind, self.job.step, self.local_dir if adapter_written else None)
            if self.tracker.problems:   # known by now: the job's reason says so
                data["reason"] = f"{data['reason']}; {'; '.join(self.tracker.problems)}"
        events.emit(kind, self.job_id, self.job.step, **data)
