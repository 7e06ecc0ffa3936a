"""The refusals every /v1 endpoint of the HTTP API may answer (its answers: orchestrator/operation_models.py)."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from orchestrator.strict_json import finite


class ErrorBody(BaseModel):
    detail: str
    errors: list[dict[str, Any]] | None = None


REFUSALS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (401, "no token, or a wrong one"), (404, "no such job"), (409, "the job's state or name conflicts"),
    (503, "the service does not answer; the reason"))}

QUOTA_REFUSAL = {429: {"model": ErrorBody, "description": "the user's quota (queued jobs, tokens of the last 24 hours) "
                                                         "does not allow it now; `detail` names the user, the quota, "
                                                         "its value and what frees it; nothing was entered",
                       "headers": {"Retry-After": {"description": "seconds to wait before trying again (the daily "
                                                                  "tokens: until enough are 24 hours old); absent "
                                                                  "for a quota of 0, which no wait frees",
                                                   "schema": {"type": "integer"}}}}}

STORE_UNREACHABLE = {502: {"model": ErrorBody, "description": "a job's data is under a storage URI (s3://...) whose "
                                                              "store this server could not reach (connection refused, "
                                                              "a name that does not resolve): `detail` names the job, "
                                                              "the URI, the endpoint and what to check; nothing was "
                                                              "entered"}}


class StrictJSONResponse(JSONResponse):
    """The HTTP API's JSON (its default response class): a NaN or infinite number (a diverged job's loss) is sent
    as null, as a browser's JSON.stringify sends it, since strict JSON parsers (the web console's
    `response.json()`, most languages' parsers) refuse the NaN/Infinity tokens, and Starlette's JSONResponse
    refuses to send them at all (a 500 instead of the answer)."""

    def render(self, content: Any) -> bytes:
        return super().render(finite(content))
