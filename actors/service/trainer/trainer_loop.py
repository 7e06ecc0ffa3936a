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
pipeline's), what it holds for each job (active_job.py) and how a job starts (job_attach.py), the link to each
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
from pathlib import Path

from actors.checkpoint import DataChanged
from actors.checkpoint.peft_io import import_peft
from actors.engine.interactive_step import FusedCalls
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch
from actors.engine.step_report import StepReport
from actors.engine.trainer import FusedTrainer
from actors.service.outputs.remote_outputs import LeavingJob, RemoteOutputs
from actors.service.outputs.tracking import CLOSE_WAIT_S, JobTracker
from actors.service.pipeline.pipeline_admission import PipelineAdmission
from actors.service.pipeline.pipeline_engine import PipelineEngine
from actors.service.pipeline.pipeline_processes import StageLost
from actors.service.scheduler.config import TrainerConfig, trainer_step_log
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.feed import JobLinkLost
from actors.service.trainer.host_collection import CollectionWindow
from actors.service.trainer.interactive_calls import InteractiveCalls
from actors.service.trainer.interactive_desk import InteractiveDesk
from actors.service.trainer.job_attach import start_job, start_tracking
from actors.service.trainer.job_ends import JobEnds
from actors.service.trainer.job_link import Assignment
from actors.service.trainer.job_waits import JobWaits
from actors.service.trainer.step_admission import StepAdmission, memory_in_use
from actors.service.trainer.step_booking import StepBooking
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.step_log import StepLog, StepTotals
from actors.service.trainer.trainer_commands import Commands
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerEvents, TrainerStatus
from actors.service.trainer.try_adapter import try_adapter
from actors.spec.trainer_settings import step_tokens_floor
from actors.storage.base_identity import base_identity
from policies.base import StepComposer

log = logging.getLogger(__name__)

CLOSE_UPLOAD_WAIT_S = 120.0       # at most this long (and upload_timeout_s) a closing trainer waits for uploads
REAP_EVERY_S = 5.0   # how often interactive models whose HTTP server went silent are looked for


class TrainerLoop:
    """A trainer's fused steps over its jobs. From any thread: `assign`, `stop_job`, `drain_events`, `status`;
    from the stepping thread: `run_once`, `close`; `active` and `leaving` are the jobs here."""

    def __init__(self, base: BaseModel | None, config: TrainerConfig, trainer_id: str, state_dir: Path,
                 composer: StepComposer | None = None, *, engine: PipelineEngine | None = None):
        """`composer`: the service policy's `compose_step`, where it has one (e.g. MinPad). `engine`: a
        pipeline trainer's (`stages: N`; the loop owns it and closes it) instead of one device's over `base`."""
        self.config = config
        self.trainer_id = trainer_id
        self.trainer: StepEngine
        self.admission: StepAdmission | PipelineAdmission
        import_peft()   # for the jobs' checkpoints, before the admission measures the process's runtime memory
        if engine is not None:
            self.trainer = engine
            # a pipeline that lost a stage is rebuilt, then admitted anew (`_restart_stages`)
            self.new_admission = lambda: PipelineAdmission(engine, config.memory_budget_bytes)
            try:
                self.admission = self.new_admission()
            except BaseException:
                engine.close()   # its stages stop with the refusal
                raise
        else:
            assert base is not None
            trainer = FusedTrainer(base, step_tokens=step_tokens_floor(config.step_tokens), layout=config.layout,
                                   composer=composer, recompute=config.recompute, compile=config.compile)
            self.trainer = trainer
            self.new_admission = lambda: StepAdmission(trainer, config.memory_budget_bytes)
            self.admission = self.new_admission()
            if config.step_tokens == "auto":   # sized for the device by the memory model
                trainer.step_tokens = self.admission.plan_step_tokens()
        self.totals = StepTotals()
        self.commands = Commands()
        self.events = TrainerEvents()
        self.active: dict[str, ActiveJob] = {}
        self.step_log = StepLog(trainer_step_log(config, Path(state_dir), trainer_id), trainer_id)
        staging_dir = Path(config.staging_dir or Path(state_dir) / "staging").expanduser()
        self.outputs = RemoteOutputs(trainer_id, staging_dir, config.upload_timeout_s, self.events,
                                     self.commands.wake)
        self.job_ids: list[str] = []   # for status(), replaced (not mutated) by the loop thread
        # what adapters record as their base: an id a serving engine resolves, and where it was loaded from
        base = self.trainer.base
        self.base_identity = base_identity(base.name, base.source, quantization=base.quantization,
                                           dtype=str(base.dtype).removeprefix("torch."))
        self.trackers: list[JobTracker] = []   # trackers still writing (waited for at close)
        self.ends = JobEnds(trainer_id, self.trainer, self.active, self.events, self.outputs, self.base_identity)
        self.booking = StepBooking(trainer_id, config, self.trainer, self.active, self.events, self.outputs,
                                   self.base_identity, self.step_log, self.totals, self.ends.finish)
        self.ends.before_end = self.booking.send_updates
        # interactive models (the Tinker API's), their calls in the jobs' steps or between them; one device only
        # (a pass no larger than a step: the trainer's memory plan covers it)
        self.interactive = (InteractiveCalls(base, window_s=config.interactive_window_s,
                                             max_pass_tokens=self.trainer.step_tokens,
                                             on_ready=self.commands.wake.set) if engine is None else None)
        self.desk = (InteractiveDesk(self.interactive, self.events, trainer_id, self.step_log.write,
                                     gpus=1 if base.device.type == "cuda" else 0,
                                     checkpoint_every=config.interactive_checkpoint_every,
                                     heartbeat_timeout_s=config.interactive_heartbeat_timeout_s)
                     if self.interactive is not None else None)
        self.next_reap = 0.0
        # full garbage collections where the host would wait anyway, once the trainer's process hands them over
        self.collection = CollectionWindow()
        self.waits = JobWaits(trainer_id, config, self.events, self.active, self.ends.finish)

    @property
    def base(self) -> BaseModel:
        return self.trainer.base

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
        base, totals, admission = self.base, self.totals, self.admission
        return TrainerStatus(
            trainer_id=self.trainer_id, incarnation=totals.incarnation, base_model=base.name,
            quantization=base.quantization, device=str(base.device),
            jobs=list(self.job_ids) + (self.desk.job_ids() if self.desk is not None else []),
            steps=self.trainer.step_count, tokens=totals.tokens, padding_tokens=totals.padding_tokens,
            busy_seconds=totals.busy_seconds, started_at=totals.started_at, base_bytes=admission.base_bytes,
            peak_memory_bytes=totals.peak_memory, memory_budget_bytes=admission.budget,
            activation_bytes_estimate=admission.activation_estimate, linear_shapes=dict(admission.linear_shapes),
            data_waits=totals.data_waits, memory_coefficients=tuple(admission.memory_model.coefficients.tolist()),
            memory_error=admission.memory_model.mean_error, longest_sequence=totals.longest_sequence,
            step_tokens=self.trainer.step_tokens, max_jobs=self.config.max_jobs,
            memory_in_use_bytes=memory_in_use(base.device),
            last_step_job_tokens=dict(self.booking.last_step_job_tokens))

    def try_prompt(self, job_id: str, prompt: str, max_new_tokens: int) -> dict:
        """From the stepping thread, between steps: `prompt` continued by the job's current adapter and by
        the base alone (actors/service/trainer/try_adapter.py)."""
        if self.trainer.generation_refusal is not None:
            raise ValueError(f"trainer {self.trainer_id}: {self.trainer.generation_refusal}")
        active = self.active.get(job_id)
        return try_adapter(self.base, {key: a.job.name for key, a in self.active.items()}, job_id,
                           active.job.step if active else 0, prompt, max_new_tokens)

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
        report = None
        if ready:
            waits_before = sum(a.feed.waits for a in self.active.values())
            chosen = self.trainer.compose(ready, fits=self.admission.fits)
            chosen = self._rollouts(chosen)
            if not chosen:
                self.booking.send_updates()
                self._publish_jobs()
                return None
            micro_batches = [JobMicroBatch(job.name, batch) for job, batch in chosen]
            shape = self.admission.shape(micro_batches)
            predicted = self.admission.predict(shape)
            resident = self.admission.predict_peak(shape) if self.admission.resident is not None else None
            measure = self.admission.measure_next_step()
            taken, calls = self._calls_for(micro_batches, measure)
            try:
                report = self.trainer.run_step(chosen, measure=measure, meanwhile=self._meanwhile, calls=calls)
            except StageLost:
                raise
            except Exception as error:  # the step failed (e.g. out of memory): its jobs fail
                log.exception("trainer %s: fused step failed", self.trainer_id)
                if taken:
                    self.interactive.fused_failed(taken, error)
                for job, _ in chosen:
                    self.ends.finish(self.active[job.name], "failed", f"fused step failed: {error!r}")
                self.booking.send_updates()   # the other jobs' (those of the step that failed went with their ends)
                self._publish_jobs()
                return None
            self.totals.data_waits += sum(a.feed.waits for a in self.active.values()) - waits_before
            call_job_tokens = None
            if taken:   # the step's shape left the calls out: its peak teaches the memory model nothing
                call_job_tokens = self.desk.job_tokens(self.interactive.fused_ran(taken, report.call_outputs),
                                                       backward=True)
            else:
                self.admission.observe(shape, report, predicted)
            self.booking.after_step(report, predicted, resident, shape.adapter_parameters, call_job_tokens)
        for active in list(self.active.values()):
            if active.job.done:
                self.ends.finish(active, "completed", f"trained {active.job.step} of {active.job.total_steps} steps")
        self._publish_jobs()
        if self.desk is not None and time.monotonic() >= self.next_reap:   # models whose server went silent
            self.desk.reap()
            self.next_reap = time.monotonic() + REAP_EVERY_S
        if report is None:   # no step to do these during
            self.booking.send_updates()
            self.collection.collect_if_due()
        interactive = self.interactive
        if interactive is not None and interactive.due():
            interactive.step()
        elif report is None:
            left = interactive.wait_left() if interactive is not None else None
            self.commands.idle(idle_wait if left is None else min(idle_wait, left))
        return report

    def _calls_for(self, micro_batches: list[JobMicroBatch], measure: bool) -> tuple[list, FusedCalls | None]:
        """Interactive models' forward_backward calls waiting now that fit the step's room (its `step_tokens`
        beside the jobs' tokens: the memory its plan covers), taken to share the step; none for a step whose
        peak is measured (what the memory model learns from) or a trainer whose stream has no place for them."""
        if self.interactive is None or measure or not self.config.interactive_in_steps or not self.trainer.fuses_calls:
            return [], None
        room = self.trainer.step_tokens - self.trainer.step_cost(micro_batches)
        if room <= 0:
            return [], None
        return self.interactive.take_for_step(room)

    def _meanwhile(self) -> None:
        """The loop's work while the device runs a step (its kernels queued, not yet read back): the last
        step's updates to the job actors, a full garbage collection when one is due (host_collection.py)."""
        self.booking.send_updates_meanwhile()
        self.collection.collect_if_due()

    def _rollouts(self, chosen: list) -> list:
        """The step's GRPO jobs' completions sampled and scored (`FusedTrainer.rollouts`); a job whose reward
        failed fails alone, the others' step goes on. (A pipeline trainer runs no GRPO job.)"""
        kept, failed = self.trainer.rollouts(chosen)
        for job, error in failed:
            self.ends.finish(self.active[job.name], "failed", f"its rollout failed: {error}")
        return kept

    # -- commands ---------------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        waiting, self.commands.deferred = self.commands.deferred, []
        self._start_all(waiting)   # deferred again while its job still leaves
        while (command := self.commands.next()) is not None:
            if command[0] == "assign":
                self._start_all(command[1])
            elif command[0] == "stop":
                _, job_id, kind, reason = command
                active = self.active.get(job_id)
                if active is not None:
                    self.ends.finish(active, kind, reason)

    def _start_all(self, assignments: list[Assignment]) -> None:
        """Start each; where a pipeline's stage is found lost while one starts (that one is given back), the
        ones after it wait for the new stages (deferred to the next boundary) rather than being dropped."""
        for index, assignment in enumerate(assignments):
            try:
                self._start(assignment)
            except StageLost:
                self.commands.deferred.extend(assignments[index + 1:])
                raise

    def _start(self, assignment: Assignment) -> None:
        job_id = assignment.job_id
        if job_id in self.leaving:   # its end waits for its upload (bounded): it starts again after that
            log.info("trainer %s: job %s starts once its last upload here ended", self.trainer_id, job_id)
            self.commands.deferred.append(assignment)
            return
        if job_id in self.active:
            log.warning("trainer %s: job %s is already running here; ignoring the second assignment",
                        self.trainer_id, job_id)
            return
        if self.trainer.lost is not None:   # a pipeline's lost stage: its stages first
            failed = self._restart_stages()
            if failed is not None:
                self.events.emit("paused", job_id, 0, reason=f"it could not start: {failed}", retry=True)
                return
        refusal = self.admission.sampling_refusal(assignment.submission.job)
        if refusal is not None:
            log.error("trainer %s: job %s could not start: %s", self.trainer_id, job_id, refusal)
            self.events.emit("failed", job_id, 0, reason=f"could not start: {refusal}")
            return
        try:
            start = start_job(assignment, self.trainer, self.outputs, self.trainer_id, prefetch=self.config.prefetch)
        except StageLost as error:   # not the job's fault: it goes back and starts again on the new stages
            self.events.emit("paused", job_id, 0, reason=f"it could not start: {error}", retry=True)
            raise
        except Exception as error:  # a job that cannot start fails alone
            if isinstance(error, DataChanged):   # the user's to act on: the message says what to do
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
                         checkpoint_note=start.note)

    # -- a pipeline that lost a stage --------------------------------------------------------------------
    def _pipeline_lost(self, error: StageLost) -> None:
        """Every job here goes back to the scheduler (to resume from its last checkpoint) and new stages start."""
        self.ends.give_back_all(error)
        self._restart_stages()
        self._publish_jobs()

    def _restart_stages(self) -> str | None:
        """New stages for a pipeline that lost one: None once they run, else why they could not start (logged;
        the engine stays lost, and the next job assigned here tries again)."""
        try:
            self.trainer.rebuild()
        except Exception as error:   # logged, and returned to the job that waits for the stages
            log.exception("trainer %s: its pipeline stages could not be started again; the next job assigned "
                          "here tries again", self.trainer_id)
            return f"its pipeline trainer's stages could not be started again ({error})"
        self.admission = self.new_admission()
        return None

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
        deadline = time.monotonic() + CLOSE_WAIT_S
        for tracker in self.trackers:   # the last metrics and artefacts of the jobs that just left
            if not tracker.wait(max(deadline - time.monotonic(), 0.0)):
                log.warning("trainer %s: job %s: its tracking did not finish writing within %.0fs; its last metrics "
                            "or its adapter artefact may be missing there", self.trainer_id, tracker.job_id,
                            CLOSE_WAIT_S)
        self.step_log.close()
        self.trainer.close()   # a pipeline's stages stop
