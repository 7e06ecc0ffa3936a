"""A job as the service reports it (`JobRecord`: one row of the job table), and the states a job passes through."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

JobState = Literal["queued", "running", "paused", "completed", "stopped_early", "failed", "cancelled"]
JOB_STATES: tuple[str, ...] = ("queued", "running", "paused", "completed", "stopped_early", "failed", "cancelled")
TERMINAL_STATES = frozenset({"completed", "stopped_early", "failed", "cancelled"})
ACTIVE_STATES: tuple[str, ...] = ("queued", "running", "paused")   # the states the scheduler decides about


def unreported_resume_point(checkpoint_step: int | None) -> str:
    """Where a job resumes whose trainer went (lost, or stopped with a restarting service) before its last
    reports were booked: its newest checkpoint on disk, which may be later than the table's (written after the
    trainer's last report); the transition that starts it again says the step it resumed from."""
    if checkpoint_step:
        return f"its newest checkpoint (step {checkpoint_step} as last reported, or a later one)"
    return "its newest checkpoint, if one was written after the last report, else the start"


@dataclass(kw_only=True)
class JobRecord:
    """A job as the service reports it."""

    id: str
    name: str
    state: str
    reason: str
    base_model: str
    quantization: str
    priority: int
    output_dir: str
    trainer: str | None
    step: int
    total_steps: int | None
    tokens: int
    loss: float | None
    eval_loss: float | None
    tokens_per_s: float | None
    checkpoint_step: int | None
    adapter_dir: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float
    user: str | None = None     # who submitted it (the HTTP API's user; None: an operator through Ray)
    eval_score: float | None = None   # the last evaluation's eval_generate score, where the job has a metric
    reward: float | None = None   # a grpo job's mean reward over its last optimizer step's completions
    reward_margin: float | None = None   # a dpo / orpo / cpo job's last step's mean rewards/margins (TRL's)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


RECORD_COLUMNS = [f.name for f in fields(JobRecord)]



def record_of(row: tuple) -> JobRecord:
    """A job record from a row of the RECORD_COLUMNS, each value under its column's name."""
    return JobRecord(**dict(zip(RECORD_COLUMNS, row, strict=True)))
