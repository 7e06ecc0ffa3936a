"""The refusals every /v1 endpoint of the HTTP API may answer (its answers: orchestrator/operation_models.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorBody(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


REFUSALS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (401, "no token, or a wrong one"), (404, "no such job"), (409, "the job's state or name conflicts"),
    (503, "the service does not answer; the reason"))}
