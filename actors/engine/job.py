"""One job as the trainer holds it: its adapter, optimizer, data cursor and accumulation state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from actors.data import DataCursor, Example
from actors.engine.adapter_surgery import AdapterHandle, add_adapter
from actors.engine.grpo_replay import GrpoReplay
from actors.engine.kept_best import KeptBest
from actors.engine.models import BaseModel
from actors.engine.optim import JobOptimizer
from actors.engine.step_records import OptimizerStepRecord, StepAccumulator
from actors.spec.job_spec import JobSpec, cursor_epochs, planned_steps


def continue_plan(job: Any, optimizer: JobOptimizer, total_steps: int) -> None:
    """`TrainingJob.plan_to`'s work on `job` (one whose `total_steps` is settable) and its `optimizer`."""
    job.total_steps = optimizer.total_steps = total_steps
    accumulation = job.spec.grad_accum
    optimizer.micro_count = -(-optimizer.micro_count // accumulation) * accumulation
    optimizer.set_lr()


class BatchSource(Protocol):
    """Where a job's micro-batches come from: a `DataCursor` in-process, or a feed streamed from a job
    actor. Positions (`state_dict`) are restorable so that checkpoints can resume exactly."""

    @property
    def exhausted(self) -> bool: ...

    def next_batch(self) -> list[Example] | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingJob:
    spec: JobSpec
    adapter: AdapterHandle
    optimizer: JobOptimizer
    cursor: BatchSource
    eval_examples: list[Example]
    total_steps: int
    seed: int
    pending: list[Example] | None = None
    cursor_state_before_pending: dict | None = None
    accumulator: StepAccumulator = field(default_factory=StepAccumulator)
    tokens_seen: int = 0
    history: list[OptimizerStepRecord] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)   # (optimizer step, eval loss), in order
    scores: list[tuple[int, float]] = field(default_factory=list)  # (optimizer step, eval_generate score)
    data_digest: str | None = None   # of the data it trains on (data/digest.py), where known: kept with its checkpoints
    replay: GrpoReplay | None = None   # a GRPO job's generation trained on num_iterations times (grpo_replay.py)
    best: KeptBest | None = None   # the adapter of its best evaluation, with keep_best (kept_best.py)

    @classmethod
    def create(cls, spec: JobSpec, base: BaseModel, train: list[Example], eval_examples: list[Example],
               *, seed: int) -> TrainingJob:
        cursor = DataCursor(train, spec.batch_size, seed=seed, epochs=cursor_epochs(spec))
        return cls.attach(spec, base, cursor, eval_examples, planned_steps(spec, len(train)), seed=seed)

    @classmethod
    def attach(cls, spec: JobSpec, base: BaseModel, source: BatchSource, eval_examples: list[Example],
               total_steps: int, *, seed: int) -> TrainingJob:
        """A job whose micro-batches come from `source` (e.g. streamed from a job actor), its adapter initialised:
        the caller starts it from `spec.init_adapter` where it restores no checkpoint of the job's
        (actors/checkpoint/initial_adapter.py: the job files' layer, above this one)."""
        adapter = add_adapter(base.model, spec.name, spec.lora, seed=seed)
        optimizer = JobOptimizer(spec, adapter.parameters(), total_steps, loss_scaling=base.dtype == torch.float16,
                                 fast_parameters=adapter.parameter_groups()[1])
        job = cls(spec, adapter, optimizer, source, eval_examples, total_steps, seed)
        if spec.grpo is not None and spec.grpo.num_iterations > 1:
            job.replay = GrpoReplay(spec.grpo.num_iterations)
        return job

    @property
    def name(self) -> str:
        return self.spec.name

    def plan_to(self, total_steps: int) -> None:
        """Train to `total_steps` from here (a job continued past its data's old end, its epochs raised:
        `job_spec.continued_steps`): its schedule the new total's from this step on, its next step's accumulation
        begun afresh (its last one may have ended short, the data then ended mid-accumulation)."""
        continue_plan(self, self.optimizer, total_steps)

    @property
    def step(self) -> int:
        return self.optimizer.step_count

    @property
    def replaying(self) -> bool:
        """Whether the job's next micro-batches replay its last generation (GRPO's num_iterations)."""
        return self.replay is not None and self.replay.replaying

    @property
    def done(self) -> bool:
        return self.step >= self.total_steps or (self.cursor.exhausted and self.pending is None
                                                  and self.accumulator.micro_batches == 0 and not self.replaying)

    def peek(self) -> list[Example] | None:
        """The job's next micro-batch, kept until taken: from its data, or (replaying) the generation's rollouts."""
        if self.pending is None and not self.done:
            if self.replay is not None and self.replay.replaying:
                self.cursor_state_before_pending = None
                self.pending = self.replay.next_batch()
            else:
                self.cursor_state_before_pending = self.cursor.state_dict()
                self.pending = self.cursor.next_batch()
        return self.pending

    def take(self) -> list[Example]:
        batch = self.peek()
        if batch is None:
            raise RuntimeError(f"job '{self.name}' has no micro-batch left")
        self.pending = None
        self.cursor_state_before_pending = None
        if self.replay is not None and self.replay.replaying:
            self.replay.taken()
        return batch

    def data_position(self) -> dict:
        """The cursor's state as of the next micro-batch not yet trained on (a peeked one included)."""
        if self.pending is not None and self.cursor_state_before_pending is not None:
            return dict(self.cursor_state_before_pending)
        return self.cursor.state_dict()

    def record_micro_batch(self, loss: float, tokens: int, targets: int) -> OptimizerStepRecord | None:
        """Book a finished micro-batch; step the optimizer when its accumulation is complete (or the
        data ran out mid-accumulation). Returns the optimizer step's record, if one was taken."""
        if not self.book_micro_batch(loss, tokens, targets):
            return None
        lr, grad_norm = self.optimizer.step(self.accumulator.targets)
        return self.optimizer_stepped(lr, grad_norm)

    def book_micro_batch(self, loss: float, tokens: int, targets: int,
                         metrics: dict[str, float] | None = None) -> bool:
        """Book a finished micro-batch; True when the job's optimizer step is due (its accumulation is
        complete, or the data ran out mid-accumulation): take it (`optimizer.step`, or the trainer's
        `joint_steps.step_jobs` with other jobs') with `accumulator.targets`, then call `optimizer_stepped`.
        A preference job's `targets` are its pairs (its optimizer's mean is over them) and `metrics` its
        rewards' means over them."""
        due = self.count_micro_batch(tokens, targets)
        self.accumulator.add_loss(loss, targets, metrics)
        return due

    def count_micro_batch(self, tokens: int, targets: int) -> bool:
        """`book_micro_batch` before the micro-batch's loss is known (a GPU step reads its losses back once,
        after the optimizer steps are queued): its sizes counted, whether the optimizer step is due; the loss
        follows with `accumulator.add_loss`, before `optimizer_stepped`."""
        self.accumulator.count(tokens, targets)
        self.tokens_seen += tokens
        due = self.optimizer.micro_step_done()
        if self.replay is not None and self.replay.replaying:   # a replay steps after the generation's micro-batches
            return self.replay.iteration_done
        if not due and self.cursor.exhausted and self.peek() is None:
            due = True
        return due

    def next_batch_ready(self) -> bool:
        """Whether `peek` answers without waiting (its batch already peeked, in memory, or already fetched)."""
        if self.pending is not None or self.done:
            return True
        ready = getattr(self.cursor, "ready", None)
        return ready is None or bool(ready(0.0))

    def optimizer_stepped(self, lr: float, grad_norm: float) -> OptimizerStepRecord:
        """The record of the optimizer step just taken; the next accumulation starts."""
        record = OptimizerStepRecord(step=self.step, loss=self.accumulator.loss, tokens=self.accumulator.tokens, lr=lr,
                                     grad_norm=grad_norm, metrics=self.accumulator.metrics)
        self.accumulator = StepAccumulator()
        self.history.append(record)
        if self.replay is not None:
            self.replay.stepped()
        return record
