"""What a trainer reports to the scheduler (collected by polling, so the trainer never waits on it)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

EventKind = Literal["step", "started", "progress", "eval", "checkpoint", "prediction", "completed", "stopped_early",
                    "cancelled", "paused", "failed"]
FINAL_KINDS = ("completed", "stopped_early", "cancelled", "paused", "failed")


@dataclass(kw_only=True)
class TrainerEvent:
    """What happened to a job (`job_id`), or, for kind `step`, one fused step of the trainer (job_id is
    empty; `data` is the step's row of the trainer's step log)."""

    kind: EventKind
    job_id: str
    step: int
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)


@dataclass(kw_only=True)
class TrainerStatus:
    """A trainer's state, polled by the scheduler (and its metrics)."""

    trainer_id: str
    incarnation: str
    base_model: str
    quantization: str
    device: str
    jobs: list[str]
    steps: int
    tokens: int
    padding_tokens: int
    busy_seconds: float           # time in fused steps
    started_at: float
    base_bytes: int               # the frozen base's weights
    peak_memory_bytes: int        # the highest step peak so far (0 before the first step)
    memory_budget_bytes: int
    activation_bytes_estimate: int   # a full step's bytes over the weights, before any step was measured
    linear_shapes: dict[str, tuple[int, int]]
    head_shape: tuple[int, int] = (0, 0)   # the LM head's (in, out): an interactive model's `train_unembed` adapter
    expert_shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)   # MoE stacks: (experts, in, out)
    data_waits: int = 0           # times a step waited for a job's data
    memory_coefficients: tuple[float, ...] = ()   # the fitted step-memory model (policies.memory_model)
    memory_error: float | None = None             # its mean relative error so far
    longest_sequence: int = 0
    step_tokens: int = 0
    max_jobs: int | None = None
    memory_in_use_bytes: int = 0  # now: allocated CUDA memory, or the process's resident memory on CPU
    last_step_job_tokens: dict[str, int] = field(default_factory=dict)   # each job's real tokens in the last step
    base_facts: dict[str, Any] = field(default_factory=dict)   # what the Tinker API says of its base (its desk's)


class TrainerEvents:
    """The events a trainer has not reported yet (thread-safe): its loop emits them, a poll drains them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: list[TrainerEvent] = []

    def emit(self, kind: EventKind, job_id: str, step: int, /, **data: Any) -> None:
        with self.lock:
            self.pending.append(TrainerEvent(kind=kind, job_id=job_id, step=step, data=data))

    def drain(self) -> list[TrainerEvent]:
        with self.lock:
            events, self.pending = self.pending, []
        return events
