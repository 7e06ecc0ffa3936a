"""The HTTP API's response models (its OpenAPI schema's) and the refusals every /v1 endpoint may answer."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from actors.service.table.job_table import JobRecord


class ErrorBody(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


class Submitted(BaseModel):
    jobs: list[JobRecord]


class LossRow(BaseModel):
    step: int
    loss: float | None = None
    tokens: int | None = None
    lr: float | None = None
    grad_norm: float | None = None
    eval_loss: float | None = None
    eval_score: float | None = None   # the job's eval_generate metric, where it has one
    time: float


class Transition(BaseModel):
    time: float
    state: str
    reason: str


class Health(BaseModel):
    status: str
    service: str
    detail: str | None = None


REFUSALS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (401, "no token, or a wrong one"), (404, "no such job"), (409, "the job's state or name conflicts"),
    (503, "the service does not answer; the reason"))}
