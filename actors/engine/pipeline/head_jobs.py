"""A job as the pipeline head sees it: its data cursor and the micro-batch peeked from it, the optimizer steps
planned, the accumulation being composed and booked, its history and losses."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.data import Example
from actors.engine.job import BatchSource, OptimizerStepRecord, StepAccumulator
from actors.spec.job_spec import JobSpec


@dataclass(kw_only=True)
class HeadJob:
    spec: JobSpec
    cursor: BatchSource
    total_steps: int
    seed: int
    micro_count: int = 0
    planned_steps: int = 0        # optimizer steps planned (their closing micro-batches composed)
    step_targets: int = 0         # targets of the accumulation being composed
    pending: list[Example] | None = None
    position_before_pending: dict | None = None
    accumulator: StepAccumulator = field(default_factory=StepAccumulator)
    history: list[OptimizerStepRecord] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)     # every micro-batch's loss, in order
    tokens_seen: int = 0
    eval_examples: list[Example] = field(default_factory=list)
    step_limit: int | None = None     # compose no micro-batch of a later optimizer step (None: up to total_steps)
    reference: dict | None = None     # its frozen reference adapter's tensors (JobSetup.reference), kept for a re-add

    @property
    def name(self) -> str:
        return self.spec.name

    def peek(self) -> list[Example] | None:
        limit = self.total_steps if self.step_limit is None else min(self.total_steps, self.step_limit)
        if self.pending is None and self.planned_steps < limit:
            self.position_before_pending = self.cursor.state_dict()
            self.pending = self.cursor.next_batch()
        return self.pending

    def data_position(self) -> dict:
        """The cursor's state as of the next micro-batch not yet planned (a peeked one included)."""
        if self.pending is not None and self.position_before_pending is not None:
            return dict(self.position_before_pending)
        return self.cursor.state_dict()

    @property
    def composable(self) -> bool:
        return self.peek() is not None

    @property
    def done(self) -> bool:
        """Every planned micro-batch is booked and no more will be planned (asks the data source nothing)."""
        no_more = self.planned_steps >= self.total_steps or (self.pending is None and self.cursor.exhausted)
        return no_more and self.accumulator.micro_batches == 0 and len(self.history) == self.planned_steps
