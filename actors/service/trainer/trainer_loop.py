"""The trainer actor's core, its loop: one base model, fused steps over whatever jobs are assigned, run
continuously. Jobs join at the next step boundary and leave (finished, stopped early, cancelled, paused,
failed) with a checkpoint and their adapter written out, without the trainer restarting.

One job's trouble stays that job's: a job whose data does not arrive within `data_grace_s` is left out of
the steps (the others go on), and after `data_timeout_s` it is checkpointed and given back to the
scheduler, as is a job whose job actor died; a job whose folder refuses writes fails after a few tries
with the reason. Checkpoints are written every `checkpoint_every` steps and every `checkpoint_every_s`
seconds, so that a crash loses bounded work. The loop drives one device's `FusedTrainer`, or a pipeline
trainer's stages (`stages: N`: actors/service/pipeline/pipeline_engine.py) through the same calls.

The loop's parts, each in its own module: what it steps (step_engine.py: one device's trainer or a
pipeline's) and its steps themselves, admitted, run, booked, and the work between them (loop_steps.py), what it
holds for each job (active_job.py), how assigned jobs start (job_starts.py, job_attach.py), the link to each
job's data and stop rule (job_link.py, stop_verdicts.py) and the waits on them (job_waits.py), memory
admission (step_admission.py), what is booked after each step (step_booking.py), how a job leaves
(job_ends.py), its step log (step_log.py), interactive models' calls, in the jobs' steps where they fit and
between them otherwise (interactive_calls.py: the Tinker API's), the jobs whose output_dir is a storage URI
(remote_outputs.py), and its commands from other threads (trainer_commands.py).

Thread-safe entry points (`assign`, `stop_job`, `drain_events`, `status`) only queue commands or copy
state; the fused steps themselves run in one thread, one `run_once` at a time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from actors.checkpoint.peft_io import import_peft
from actors.engine.models import BaseModel
from actors.engine.step_report import StepReport
from actors.service.outputs.remote_outputs import LeavingJob, RemoteOutputs
from actors.service.outputs.tracking import CLOSE_WAIT_S
from actors.service.pipeline.pipeline_engine import PipelineEngine
from actors.service.pipeline.pipeline_processes import StageLost
from actors.service.scheduler.config import TrainerConfig, trainer_step_log
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.feed import JobLinkLost
from actors.service.trainer.host_collection import CollectionWindow
from actors.service.trainer.interactive_calls import InteractiveCalls
from actors.service.trainer.interactive_desk import InteractiveDesk
from actors.service.trainer.job_ends import JobEnds
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.job_starts import JobStarts
from actors.service.trainer.job_waits import JobWaits
from actors.service.trainer.loop_steps import LoopSteps, admitted_engine
from actors.service.trainer.step_admission import memory_in_use
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.step_log import StepLog
from actors.service.trainer.trainer_commands import Commands
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerEvents, TrainerStatus
from actors.service.trainer.try_adapter import try_adapter, try_saved_adapter
from actors.spec.job_spec import JobSpec
from actors.storage.base_identity import base_identity
from actors.storage.storage_uri import as_location
from policies.base import StepComposer

log = logging.getLogger(__name__)

CLOSE_UPLOAD_WAIT_S = 120.0       # at most this long (and upload_timeout_s) a closing trainer waits for uploads


class TrainerLoop:
    """A trainer's fused steps over its jobs. From any thread: `assign`, `stop_job`, `drain_events`, `status`;
    from the stepping thread: `run_once`, `close`; `active` and `leaving` are the jobs here."""

    def __init__(self, base: BaseModel | None, config: TrainerConfig, trainer_id: str, state_dir: Path,
                 composer: StepComposer | None = None, *, engine: PipelineEngine | None = None):
        """`composer`: the service policy's `compose_step`, where it has one (e.g. MinPad). `engine`: a
        pipeline trainer's (`stages: N`; the loop owns it and closes it) instead of one device's over `base`."""
        self.config = config
        self.trainer_id = trainer_id
        import_peft()   # for the jobs' checkpoints, before the admission measures the process's runtime memory
        stepped, admission, new_admission = admitted_engine(base, config, composer, engine)
        self.commands = Commands()
        self.events = TrainerEvents()
        self.active: dict[str, ActiveJob] = {}
        staging_dir = Path(config.staging_dir or Path(state_dir) / "staging").expanduser()
        self.outputs = RemoteOutputs(trainer_id, staging_dir, config.upload_timeout_s, self.events,
                                     self.commands.wake)
        self.job_ids: list[str] = []   # for status(), replaced (not mutated) by the loop thread
        # what adapters record as their base: an id a serving engine resolves, and where it was loaded from
        loaded = stepped.base
        identity = base_identity(loaded.name, loaded.source, quantization=loaded.quantization,
                                 dtype=str(loaded.dtype).removeprefix("torch."))
        self.ends = JobEnds(trainer_id, stepped, self.active, self.events, self.outputs, identity)
        self.steps = LoopSteps(trainer_id, config, stepped, admission, new_admission, self.active, self.ends,
                               events=self.events, outputs=self.outputs, base_identity=identity,
                               step_log=StepLog(trainer_step_log(config, Path(state_dir), trainer_id), trainer_id),
                               wake=self.commands.wake.set, interactive=engine is None)
        self.ends.before_end = self.steps.booking.send_updates
        self.starts = JobStarts(trainer_id, self.steps, self.active, self.events, self.outputs, self.commands,
                                config.prefetch)
        self.waits = JobWaits(trainer_id, config, self.events, self.active, self.ends.finish)

    @property
    def trainer(self) -> StepEngine:
        """What the loop steps: one device's FusedTrainer or a pipeline's engine."""
        return self.steps.engine

    @property
    def base(self) -> BaseModel:
        return self.trainer.base

    @property
    def interactive(self) -> InteractiveCalls | None:
        return self.steps.interactive

    @property
    def desk(self) -> InteractiveDesk | None:
        return self.steps.desk

    @property
    def collection(self) -> CollectionWindow:
        return self.steps.collection

    @property
    def step_log(self) -> StepLog:
        return self.steps.booking.step_log

    @property
    def leaving(self) -> dict[str, LeavingJob]:
        """Jobs off the steps whose end waits for their final upload."""
        return self.outputs.leaving

    # -- thread-safe entry points -------------------------------------------------------------------
    def assign(self, assignments: Assignment | list[Assignment]) -> None:
        """Start jobs at the next step boundary (a list starts together)."""
        self.commands.put(("assign", assignments if isinstance(assignments, list) else [assignments]))

    def stop_job(self, job_id: str, kind: str, reason: str) -> None:
        """End a job at the next step boundary: `cancelled` or `paused` (both checkpoint it first)."""
        if kind not in ("cancelled", "paused"):
            raise ValueError(f"stop kind must be 'cancelled' or 'paused', not '{kind}'")
        self.commands.put(("stop", job_id, kind, reason))

    def has_work(self) -> bool:
        """Jobs here (training, waiting for data or leaving), commands queued, or interactive models open."""
        return bool(self.job_ids) or not self.commands.empty() or (self.desk is not None and bool(self.desk.job_ids()))

    def drain_events(self) -> list[TrainerEvent]:
        return self.events.drain()

    def status(self) -> TrainerStatus:
        base, steps = self.base, self.steps
        totals, admission = steps.totals, steps.admission
        return TrainerStatus(
            trainer_id=self.trainer_id, incarnation=totals.incarnation, base_model=base.name,
            quantization=base.quantization, device=str(base.device),
            jobs=list(self.job_ids) + (steps.desk.job_ids() if steps.desk is not None else []),
            steps=self.trainer.step_count, tokens=totals.tokens, padding_tokens=totals.padding_tokens,
            busy_seconds=totals.busy_seconds, started_at=totals.started_at, base_bytes=admission.base_bytes,
            peak_memory_bytes=totals.peak_memory, memory_budget_bytes=admission.budget,
            activation_bytes_estimate=admission.activation_estimate, linear_shapes=dict(admission.linear_shapes),
            expert_shapes=dict(admission.expert_shapes), head_shape=tuple(base.lm_head.weight.shape[::-1]),
            data_waits=totals.data_waits, memory_coefficients=tuple(admission.memory_model.coefficients.tolist()),
            memory_error=admission.memory_model.mean_error, longest_sequence=totals.longest_sequence,
            step_tokens=self.trainer.step_tokens, max_jobs=self.config.max_jobs,
            memory_in_use_bytes=memory_in_use(base.device),
            last_step_job_tokens=dict(steps.booking.last_step_job_tokens),
            base_facts=steps.desk.facts() if steps.desk is not None else {})

    def try_prompt(self, job_id: str, prompt: str, max_new_tokens: int,
                   withdrawn: Callable[[], bool] | None = None) -> dict:
        """From the stepping thread, between steps: `prompt` continued by the job's current adapter and by
        the base alone (actors/service/trainer/try_adapter.py); `withdrawn`: whether its caller stopped waiting,
        asked between decode steps (the generation stops then)."""
        if self.trainer.generation_refusal is not None:
            raise ValueError(f"trainer {self.trainer_id}: {self.trainer.generation_refusal}")
        active = self.active.get(job_id)
        return try_adapter(self.base, {key: a.job.name for key, a in self.active.items()}, job_id,
                           active.job.step if active else 0, prompt, max_new_tokens, self.trainer.decode,
                           withdrawn)

    def try_saved(self, job_id: str, spec: JobSpec, location: str, step: int, prompt: str,
                  max_new_tokens: int, withdrawn: Callable[[], bool] | None = None) -> dict:
        """As `try_prompt`, through the adapter a finished job saved in its folder (`location`), attached for the
        call only (actors/service/trainer/try_adapter.py)."""
        if self.trainer.generation_refusal is not None:
            raise ValueError(f"trainer {self.trainer_id}: {self.trainer.generation_refusal}")
        return try_saved_adapter(self.base, spec, as_location(location), job_id, step, prompt, max_new_tokens,
                                 self.trainer.held_adapters,   # a pipeline: each stage holds its share
                                 withdrawn)

    # -- the loop -------------------------------------------------------------------------------------
    def run_once(self, idle_wait: float = 0.2) -> StepReport | None:
        """Apply the verdicts that are due and pending commands, run one fused step if any job has data,
        end the jobs that are done. Verdicts first: a job whose stop is due stops even when a pause for it
        arrived at the same step boundary, as it would have without the pause. The background uploads that
        ended meanwhile are taken first (events, the next upload, the leaving jobs' ends)."""
        try:
            return self._run_once(idle_wait)
        except StageLost as error:   # a pipeline's stage: every job here goes back, the stages start again
            self._pipeline_lost(error)
            return None

    def _run_once(self, idle_wait: float) -> StepReport | None:
        self._collect_uploads()
        for active in list(self.active.values()):
            self.waits.apply_verdicts(active)
        self._apply_commands()
        self.steps.reap_due()
        ready = self._ready_jobs()
        report = None
        if ready:
            report = self.steps.run(ready)
            if report is None:   # none chosen, or the step failed (its jobs ended with the reason)
                self._publish_jobs()
                return None
        for active in list(self.active.values()):
            if active.job.done:
                self.ends.finish(active, "completed", f"trained {active.job.step} of {active.job.total_steps} steps")
        self._publish_jobs()
        idle = self.steps.between(report)
        if idle is not None:
            self.commands.idle(min(idle_wait, idle))
        return report

    def _ready_jobs(self) -> list:
        """The jobs whose next micro-batch is at hand, each waited for up to `data_grace_s` in all; a job whose
        job actor died goes back to the scheduler, one whose data link broke fails (the others go on)."""
        ready = []
        deadline = time.monotonic() + self.config.data_grace_s
        for active in list(self.active.values()):
            try:
                if self.waits.data_arrived(active, deadline) and active.job.peek() is not None:
                    ready.append(active.job)
            except JobLinkLost as error:   # its job actor died: the job itself is intact
                self.waits.give_back(active, f"its job actor was lost ({error})")
            except Exception as error:  # noqa: BLE001 - the job's data link broke: that job fails
                self.ends.finish(active, "failed", f"could not get the job's data: {error!r}")
        return ready

    # -- commands ---------------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        waiting, self.commands.deferred = self.commands.deferred, []
        self.starts.start_all(waiting)   # deferred again while its job still leaves
        while (command := self.commands.next()) is not None:
            if command[0] == "assign":
                self.starts.start_all(command[1])
            elif command[0] == "stop":
                _, job_id, kind, reason = command
                active = self.active.get(job_id)
                if active is not None:
                    self.ends.finish(active, kind, reason)

    # -- a pipeline that lost a stage --------------------------------------------------------------------
    def _pipeline_lost(self, error: StageLost) -> None:
        """Every job here goes back to the scheduler (to resume from its last checkpoint) and new stages start."""
        self.ends.give_back_all(error)
        self.steps.restart_stages()
        self._publish_jobs()

    def _collect_uploads(self) -> None:
        self.outputs.collect(self.active)
        self._publish_jobs()

    def _publish_jobs(self) -> None:
        self.job_ids = list(self.active) + [job_id for job_id in self.leaving if job_id not in self.active]

    def close(self) -> None:
        for active in list(self.active.values()):
            self.ends.finish(active, "paused", "the trainer is shutting down")
        self.outputs.close(min(self.config.upload_timeout_s, CLOSE_UPLOAD_WAIT_S))
        self._publish_jobs()
        self.starts.wait_for_trackers(CLOSE_WAIT_S)   # the last metrics and artefacts of the jobs that just left
        self.step_log.close()
        self.trainer.close()   # a pipeline's stages stop
