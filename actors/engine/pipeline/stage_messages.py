"""What the head says to every pipeline stage: its messages' kinds, the records they carry, the settings.

Each message is a tuple `(kind, *arguments)`, its kind a `StageMessageKind`; some carry a record (a plan, a
job to add, an evaluation). Stage 0 takes them in its own process (actors/engine/pipeline/head.py); the
others receive them pickled over the control channel (actors/engine/pipeline/transport.py), from the same
code."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from actors.engine.packing import JobMicroBatch
from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan
from actors.spec.job_spec import JobSpec


class StageMessageKind(StrEnum):
    """A head's message to the stages, with its arguments; the values are the words the messages had as
    plain strings (a StrEnum member equals its word)."""

    PLAN = "plan"               # a `PlanMessage`: fed to every stage's schedule, then run
    ADD_JOB = "add"             # a `JobSetup`
    REMOVE_JOB = "remove"       # a job's name: it leaves once its operations are done
    READ_JOB = "read"           # a job's name: its state is gathered at stage 0
    DRAIN = "drain"             # run everything fed so far to its end
    STATS = "stats"             # answered: the stage's busy time and bubble share
    MEMORY = "memory"           # answered: the stage's memory model (`StageMemory`)
    MEASURE = "measure"         # True or False: open or close the allocator's window; closing answers its peak
    EVALUATE = "eval"           # an `EvalRequest`
    GENERATE = "generate"       # a `stage_generation.GenerateRequest`: serve its decoding steps until told to stop
    HOLD = "hold"               # a `stage_generation.HeldAdapter`: add (answered: its share's tensors), fill, drop
    STOP = "stop"               # every stage but stage 0 ends its process (pipeline_processes.py)


REPLYING = frozenset({StageMessageKind.STATS, StageMessageKind.MEMORY, StageMessageKind.MEASURE,   # answered
                      StageMessageKind.HOLD})


@dataclass(frozen=True, kw_only=True)
class StageSettings:
    layout: str = "packed"
    loss_chunk: int = 1024
    recompute: str = "none"
    backward_ratio: float = 2.0
    flush: bool = False       # a generic pipeline's flush at every step (bench/pipeline.py's comparison only)
    lora_grouping: str | None = None   # actors.engine.lora_grouped.GROUPING in every stage process (None: as it is)


@dataclass(frozen=True, kw_only=True)
class PlanMessage:
    """A plan with what the stages need to run it: the jobs' micro-batches, and for each job it closes the
    number of targets (tokens, or a preference job's pairs) its optimizer step is the mean over."""

    plan: MicroBatchPlan
    micro_batches: tuple[JobMicroBatch, ...]
    step_targets: dict[str, int] = field(default_factory=dict)
    # DPO: the pairs whose reference log-probabilities the last stage lacks (`ReferenceCache.missing` of the
    # plan's DPO micro-batches), run through the stages with no adapter before the plan's forward
    references: tuple = ()
    # GRPO num_iterations: a replayed micro-batch's completion tokens' log-probabilities at their generation (CPU,
    # float32), by its index among `micro_batches`
    olds: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """A job's evaluation: its eval batches (each with the DPO reference pairs to compute first, if any)."""

    job: str
    batches: tuple[tuple[JobMicroBatch, tuple], ...]


@dataclass(frozen=True, kw_only=True)
class JobSetup:
    spec: JobSpec
    seed: int
    total_steps: int
    state: dict | None = None    # `job_state` of an earlier run: every stage takes its own tensors
    reference: dict | None = None   # its frozen reference adapter's tensors by parameter name (each stage its own)
