"""A pipeline trainer in the simulator: the real LoRA-aware pipeline schedule
(actors/engine/pipeline/pipeline_schedule.py) fed the simulated micro-batches, and the optimizer steps they close."""

from __future__ import annotations

from typing import Any, Protocol

from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan, OpKind, PipelineSchedule
from orchestrator.simulator.sim_trace import TrainerSpec


class Simulator(Protocol):
    """What a pipeline's closed optimizer steps are handed to (sim_replay.py's `Simulator`)."""

    jobs: dict[str, Any]

    def after_optimizer_step(self, job: Any, now: float) -> None: ...


class PipelineModel:
    """A pipeline trainer's schedule in the simulator: its plans, and the optimizer steps they close."""

    def __init__(self, trainer: TrainerSpec):
        self.stages = trainer.stages
        self.transfer = trainer.transfer_seconds
        self.schedule = PipelineSchedule(trainer.stages, transfer=trainer.transfer_seconds)
        self.closing: dict[int, tuple[str, ...]] = {}
        self.fed = 0

    def add(self, simulator: Simulator, jobs: list[str], closes: list[str], seconds: float, now: float) -> None:
        # each stage: 1/stages of the step's layers, forward and backward (backward twice the forward)
        forward = seconds / self.stages / (1 + self.schedule.backward_ratio)
        self.closing[self.fed] = tuple(closes)
        self.schedule.add_plan(MicroBatchPlan(index=self.fed, jobs=tuple(jobs), closes=tuple(closes), cost=forward,
                                              not_before=now))
        self.fed += 1
        self._land(simulator)

    def drain(self, simulator: Simulator) -> float:
        """Run everything in flight to its end; when that is."""
        self.schedule.drain()
        self._land(simulator)
        return self.schedule.state[0].free_at

    def in_flight(self) -> bool:
        return not self.schedule.idle()

    def next_free(self) -> float:
        return self.schedule.state[0].free_at

    def _land(self, simulator: Simulator) -> None:
        """The optimizer steps of the plans whose stage-0 backward was decided."""
        for op in self.schedule.take(0):
            if op.kind in (OpKind.BACKWARD, OpKind.FORWARD_BACKWARD) and op.index in self.closing:
                for name in self.closing.pop(op.index):
                    job = simulator.jobs[name]
                    if job.state == "done":
                        continue
                    job.micro = job.planned
                    job.step += 1
                    simulator.after_optimizer_step(job, op.end)
        for stage in range(1, self.stages):
            self.schedule.take(stage)
