"""A job as the service reports it (`JobRecord`: one row of the job table), and the states a job passes through."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from typing_extensions import TypedDict

from actors.service.table.table_schema import read_back, stored

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


class BestEvaluation(TypedDict):   # typing_extensions': pydantic (the HTTP API's models) reads it on Python 3.11
    """A keep_best job's best evaluation so far (actors/engine/kept_best.py): the adapter it ends with is this
    step's; its folder's aspen.json records the same `best` at its end."""

    metric: Literal["eval_loss", "eval_score"]
    step: int
    value: float


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
    best: BestEvaluation | None = None   # a keep_best job's best evaluation so far: the step whose adapter it keeps
    # the real tokens of every fused step the job took part in (its user's account: docs/users.md), those it trained
    # again after resuming from an earlier checkpoint included: unlike `tokens`, it never goes back
    account_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def adapter_step(record: JobRecord) -> int:
    """The step of the adapter in a job's folder once it ended: a keep_best job's best evaluation's (the adapter it
    keeps), else its last step's."""
    return record.best["step"] if record.best is not None else record.step


def best_text(best: BestEvaluation | None) -> str:
    """A keep_best job's best evaluation as people read it: `eval loss 0.4321 at step 12` ("-" for None)."""
    if best is None:
        return "-"
    return f"{best['metric'].replace('_', ' ')} {best['value']:.4g} at step {best['step']}"


RECORD_COLUMNS = [f.name for f in fields(JobRecord)]
JSON_COLUMNS = ("best",)   # columns the table keeps as JSON text
NUMBER_COLUMNS = tuple(f.name for f in fields(JobRecord) if "float" in str(f.type))   # a NaN kept as text (stored)


def record_of(row: tuple) -> JobRecord:
    """A job record from a row of the RECORD_COLUMNS, each value under its column's name (JSON_COLUMNS decoded)."""
    values = dict(zip(RECORD_COLUMNS, row, strict=True))
    for column in NUMBER_COLUMNS:
        values[column] = read_back(values[column])
    for column in JSON_COLUMNS:
        if isinstance(values[column], str):
            values[column] = json.loads(values[column])
    return JobRecord(**values)


def column_values(values: dict[str, Any]) -> dict[str, Any]:
    """Values for the table's columns: JSON_COLUMNS' as JSON text (None stays NULL), a NaN as `stored` keeps it."""
    return {key: json.dumps(value) if key in JSON_COLUMNS and value is not None else stored(value)
            for key, value in values.items()}


def page_cursor(record: JobRecord) -> str:
    """Where a page of jobs (oldest first: by submitted_at, then id) ends: `<submitted_at>,<id>`; the next page is
    the jobs after it (`GET /v1/jobs?after=...`, `Client.jobs(after=...)`)."""
    return f"{record.submitted_at!r},{record.id}"


def parse_cursor(cursor: str) -> tuple[float, str]:
    """`page_cursor`'s text as (submitted_at, id); ValueError saying what a cursor is."""
    when, comma, job_id = cursor.partition(",")
    try:
        if not comma or not job_id:
            raise ValueError
        return float(when), job_id
    except ValueError:
        raise ValueError(f"after={cursor!r} is no page cursor: give the `after` of the previous page's next link "
                         "(`<submitted_at>,<job id>` of its last job)") from None
