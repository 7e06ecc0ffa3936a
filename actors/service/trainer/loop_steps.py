"""The device side of a trainer loop (`LoopSteps`, which the loop in trainer_loop.py holds): its step engine
(one device's `FusedTrainer` or a pipeline's stages) under its memory admission, one fused step at a time
over the jobs whose data is at hand (composed, admitted, shared with interactive models' calls that fit,
run, booked), and the work between steps (interactive passes, models whose server went silent reaped, the
jobs' updates sent, full garbage collections). A step that fails fails its jobs; the loop goes on. A
pipeline that lost a stage gets new stages and a new admission (`restart_stages`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from actors.engine.interactive_step import FusedCalls
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch
from actors.engine.step_report import StepReport
from actors.engine.trainer import FusedTrainer
from actors.service.outputs.remote_outputs import RemoteOutputs
from actors.service.pipeline.pipeline_admission import PipelineAdmission
from actors.service.pipeline.pipeline_engine import PipelineEngine
from actors.service.pipeline.pipeline_processes import StageLost
from actors.service.scheduler.config import TrainerConfig
from actors.service.trainer.active_job import ActiveJob
from actors.service.trainer.host_collection import CollectionWindow
from actors.service.trainer.interactive_calls import InteractiveCalls
from actors.service.trainer.interactive_desk import InteractiveDesk
from actors.service.trainer.job_ends import JobEnds
from actors.service.trainer.step_admission import StepAdmission, default_memory_budget
from actors.service.trainer.step_booking import StepBooking
from actors.service.trainer.step_engine import StepEngine
from actors.service.trainer.step_log import StepLog, StepTotals
from actors.service.trainer.trainer_reports import TrainerEvents
from actors.spec.trainer_settings import step_tokens_floor
from actors.storage.base_identity import BaseIdentity
from policies.base import StepComposer

log = logging.getLogger(__name__)

REAP_EVERY_S = 5.0   # how often interactive models whose HTTP server went silent are looked for

Admission = StepAdmission | PipelineAdmission


def admitted_engine(base: BaseModel | None, config: TrainerConfig, composer: StepComposer | None,
                    engine: PipelineEngine | None) -> tuple[StepEngine, Admission, Callable[[], Admission]]:
    """The loop's step engine, its admission, and how that is made again (after a pipeline's new stages): a
    pipeline's `engine` as given (its stages stopped when its admission is refused), else one device's
    `FusedTrainer` over `base`, its `step_tokens: auto` sized for the device by the memory model."""
    if engine is not None:
        pipeline = engine

        def new_admission() -> Admission:
            return PipelineAdmission(pipeline, config.memory_budget_bytes)
        try:
            return engine, new_admission(), new_admission
        except BaseException:
            engine.close()   # its stages stop with the refusal
            raise
    assert base is not None, "one device's trainer needs its base model"
    trainer = FusedTrainer(base, step_tokens=step_tokens_floor(config.step_tokens), layout=config.layout,
                           composer=composer, recompute=config.recompute, compile=config.compile)
    budget = config.memory_budget_bytes
    if budget is None and base.device.type == "cuda" and 0 < config.num_gpus < 1:   # its share of a shared GPU
        budget = default_memory_budget(base.device, gpu_share=config.num_gpus)
    admission = StepAdmission(trainer, budget)
    if config.step_tokens == "auto":   # sized for the device by the memory model
        trainer.step_tokens = admission.plan_step_tokens()
    return trainer, admission, lambda: StepAdmission(trainer, budget)


class LoopSteps:
    """A trainer's fused steps over the loop's jobs (`active`, shared with the loop) and what runs between
    them. `interactive`: interactive models' calls (the Tinker API's) run here, in the jobs' steps or between
    them (one device only: a pass no larger than a step, which the trainer's memory plan covers)."""

    def __init__(self, trainer_id: str, config: TrainerConfig, engine: StepEngine, admission: Admission,
                 new_admission: Callable[[], Admission], active: dict[str, ActiveJob], ends: JobEnds, *,
                 events: TrainerEvents, outputs: RemoteOutputs, base_identity: BaseIdentity, step_log: StepLog,
                 wake: Callable[[], None], interactive: bool):
        self.trainer_id = trainer_id
        self.config = config
        self.engine = engine
        self.new_admission = new_admission
        self.admission = admission
        self.active = active
        self.ends = ends
        self.booking = StepBooking(trainer_id, config, engine, active, events, outputs, base_identity, step_log,
                                   StepTotals(), ends.finish)
        base = engine.base
        calls = (InteractiveCalls(base, window_s=config.interactive_window_s, max_pass_tokens=engine.step_tokens,
                                  on_ready=wake, sample_slice_s=config.interactive_sample_slice_s)
                 if interactive else None)
        self.desk = (InteractiveDesk(calls, events, trainer_id, step_log.write,
                                     gpus=1 if base.device.type == "cuda" else 0,
                                     checkpoint_every=config.interactive_checkpoint_every,
                                     heartbeat_timeout_s=config.interactive_heartbeat_timeout_s)
                     if calls is not None else None)
        self.next_reap = 0.0
        # full garbage collections where the host would wait anyway, once the trainer's process hands them over
        self.collection = CollectionWindow()

    @property
    def interactive(self) -> InteractiveCalls | None:
        return self.desk.calls if self.desk is not None else None

    @property
    def totals(self) -> StepTotals:
        return self.booking.totals

    def run(self, ready: list) -> StepReport | None:
        """One fused step over jobs of `ready` (those with data at hand) as the engine composes it under the
        admission; None when none was chosen or the step failed (its jobs then failed with the reason). A
        pipeline's lost stage is raised (StageLost) for the loop to give every job back."""
        waits_before = sum(a.feed.waits for a in self.active.values())
        held = self.interactive.sampling_bytes() if self.interactive is not None else 0   # a sampling's KV cache
        fits = self.admission.fits if not held else (lambda micro_batches: self.admission.fits(micro_batches, held))
        chosen = self.engine.compose(ready, fits=fits)
        chosen = self._rollouts(chosen)
        if not chosen:
            self.booking.send_updates()
            return None
        micro_batches = [JobMicroBatch(job.name, batch) for job, batch in chosen]
        admission = self.admission
        shape = admission.shape(micro_batches)
        predicted = admission.predict(shape)
        resident = admission.predict_peak(shape) if admission.resident is not None else None
        measure = admission.measure_next_step()
        taken, calls = self._calls_for(micro_batches, measure, held)
        try:
            report = self.engine.run_step(chosen, measure=measure, meanwhile=self._meanwhile, calls=calls)
        except StageLost:
            raise
        except Exception as error:  # the step failed (e.g. out of memory): its jobs fail
            log.exception("trainer %s: fused step failed", self.trainer_id)
            if taken:
                self.interactive.fused_failed(taken, error)
            for job, _ in chosen:
                self.ends.finish(self.active[job.name], "failed", f"fused step failed: {error!r}")
            self.booking.send_updates()   # the other jobs' (those of the step that failed went with their ends)
            return None
        self.totals.data_waits += sum(a.feed.waits for a in self.active.values()) - waits_before
        call_job_tokens = None
        if taken:   # the step's shape left the calls out: its peak teaches the memory model nothing
            call_job_tokens = self.desk.job_tokens(self.interactive.fused_ran(taken, report.call_outputs),
                                                   backward=True)
        elif not held:   # a sampling's cache in the peak would teach the model bytes its steps do not have
            admission.observe(shape, report, predicted)
        self.booking.after_step(report, predicted, resident, shape.adapter_parameters, call_job_tokens)
        return report

    def reap_due(self) -> None:
        """End the models whose server went silent, when a look is due: at a pass's start, before its step, so that
        the heartbeats a trainer actor received while its last pass ran (they wait in its queue until the pass
        ends) count; looked for after a long step, every model would look silent."""
        if self.desk is not None and time.monotonic() >= self.next_reap:
            self.desk.reap()
            self.next_reap = time.monotonic() + REAP_EVERY_S

    def between(self, report: StepReport | None) -> float | None:
        """The work after a loop pass: without a step (`report` None) the updates sent and a full collection
        when due; then an interactive pass when one is due. How long the loop may idle (at most), or None when it
        should go on at once."""
        if report is None:   # no step to do these during
            self.booking.send_updates()
            self.collection.collect_if_due()
        interactive = self.interactive
        if interactive is not None and interactive.due():
            held = interactive.sampling_bytes()   # its passes beside a sampling's KV cache: as much as fits
            interactive.max_pass_tokens = self.admission.pass_tokens(held) if held else self.engine.step_tokens
            interactive.step()
            return None
        if report is not None:
            return None
        left = interactive.wait_left() if interactive is not None else None
        return math.inf if left is None else left

    def restart_stages(self) -> str | None:
        """New stages for a pipeline that lost one: None once they run, else why they could not start (logged;
        the engine stays lost, and the next job assigned here tries again)."""
        try:
            self.engine.rebuild()
        except Exception as error:   # logged, and returned to the job that waits for the stages
            log.exception("trainer %s: its pipeline stages could not be started again; the next job assigned "
                          "here tries again", self.trainer_id)
            return f"its pipeline trainer's stages could not be started again ({error})"
        self.admission = self.new_admission()
        return None

    def _calls_for(self, micro_batches: list[JobMicroBatch], measure: bool,
                   held: int = 0) -> tuple[list, FusedCalls | None]:
        """Interactive models' forward_backward calls waiting now that fit the step's room (its `step_tokens`
        beside the jobs' tokens: the memory its plan covers; beside `held` bytes of a sampling's KV cache, the
        tokens that fit with it), taken to share the step; none for a step whose peak is measured (what the memory
        model learns from) or a trainer whose stream has no place for them."""
        interactive, engine = self.interactive, self.engine
        if interactive is None or measure or not self.config.interactive_in_steps or not engine.fuses_calls:
            return [], None
        limit = min(engine.step_tokens, self.admission.pass_tokens(held)) if held else engine.step_tokens
        room = limit - engine.step_cost(micro_batches)
        if room <= 0:
            return [], None
        return interactive.take_for_step(room)

    def _meanwhile(self) -> None:
        """The loop's work while the device runs a step (its kernels queued, not yet read back): the last
        step's updates to the job actors, a full garbage collection when one is due (host_collection.py)."""
        self.booking.send_updates_meanwhile()
        self.collection.collect_if_due()

    def _rollouts(self, chosen: list) -> list:
        """The step's GRPO jobs' completions sampled and scored (`FusedTrainer.rollouts`); a job whose reward
        failed fails alone, the others' step goes on (on a pipeline trainer, sampled over its stages)."""
        kept, failed = self.engine.rollouts(chosen)
        for job, error in failed:
            self.ends.finish(self.active[job.name], "failed", f"its rollout failed: {error}")
        return kept
