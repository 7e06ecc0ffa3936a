"""A job as the pipeline head sees it: its data cursor and the micro-batch peeked from it (or the next of those
prepared for it: a GRPO job's accumulation, sampled before the step), the optimizer steps planned, the
accumulation being composed and booked, its history and losses."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from actors.data import Example
from actors.engine.grpo_replay import GrpoReplay, ReplayedBatch
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
    prepared: list[list] = field(default_factory=list)   # micro-batches to compose after `pending`, in order
    accumulator: StepAccumulator = field(default_factory=StepAccumulator)
    history: list[OptimizerStepRecord] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)     # every micro-batch's loss, in order
    tokens_seen: int = 0
    eval_examples: list[Example] = field(default_factory=list)
    step_limit: int | None = None     # compose no micro-batch of a later optimizer step (None: up to total_steps)
    reference: dict | None = None     # its frozen reference adapter's tensors (JobSetup.reference), kept for a re-add
    replay: GrpoReplay | None = None  # a GRPO job's generation trained on num_iterations times (grpo_replay.py)
    awaiting: deque[ReplayedBatch] = field(default_factory=deque)   # generation micro-batches, logps not booked yet

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def replaying(self) -> bool:
        """Whether the micro-batches composed next replay the job's last generation (GRPO's num_iterations)."""
        return self.replay is not None and self.replay.replaying

    def peek(self) -> list[Example] | None:
        limit = self.total_steps if self.step_limit is None else min(self.total_steps, self.step_limit)
        if self.pending is not None or self.planned_steps >= limit:
            return self.pending
        if self.replay is not None and self.replay.replaying:
            self.position_before_pending = None
            self.pending = self.replay.next_batch()
        elif self.prepared:   # already read from the cursor (`data_position` is past it)
            self.position_before_pending = None
            self.pending = self.prepared.pop(0)
        else:
            self.position_before_pending = self.cursor.state_dict()
            self.pending = self.cursor.next_batch()
        return self.pending

    def composed(self, rows: list) -> torch.Tensor | None:
        """A GRPO job's micro-batch `rows` composed: replaying, its completions' log-probabilities at their
        generation (the replay moves on); generating, kept to replay, its log-probabilities awaited
        (`generation_booked`). None for other jobs and for a generation."""
        if self.replay is None:
            return None
        if self.replay.replaying:
            old = self.replay.old_logps(rows)
            self.replay.taken()
            return old
        self.awaiting.append(self.replay.record(rows, None))
        return None

    def generation_booked(self, logps: torch.Tensor) -> None:
        """The last stage's log-probabilities of the oldest awaited generation micro-batch's completion tokens."""
        self.awaiting.popleft().old_logps = logps.detach().to(torch.float32)

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
        no_more = self.planned_steps >= self.total_steps or (
            self.pending is None and not self.prepared and self.cursor.exhausted and not self.replaying)
        return no_more and self.accumulator.micro_batches == 0 and len(self.history) == self.planned_steps
