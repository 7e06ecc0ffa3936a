"""The Tinker SDK's calls that make no sense on aspen, each answered with an error the SDK raises as its own type
(400: `tinker.BadRequestError`; 422: `tinker.UnprocessableEntityError`) and a message saying why and what aspen
offers instead, where before an unknown route answered 404 'Not Found' (or 405 'Method Not Allowed': a search's
POST /sessions/search met get_session's GET /sessions/{id}), which reads as a missing session or checkpoint. None is
answered with a retryable status (408, 409, 429, 5xx): the SDK would retry it for minutes. Also the health check
the SDK's low-level client asks (`healthz`). docs/tinker_coverage.md lists every SDK call and its route."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Depends, HTTPException
from tinker import types

NO_PROJECTS = "aspen has no projects: a session, its runs and checkpoints are its user's; nothing to assign"
NO_AUDIT = ("AdminClient.get_audit_log: aspen records no Tinker audit events (checkpoint reads, projects, teams); "
            "its own audit log (job, sweep and user actions) is GET /v1/audit on aspen's API, for admins")
NO_BILLING = ("AdminClient.get_billing_usage: aspen bills nothing; what each user's jobs used (each Tinker model "
              "is a job: tokens, step-seconds, GPU-seconds) is GET /v1/accounts on aspen's API; the checkpoints' "
              "storage is AdminClient.get_current_checkpoint_storage_usage")
NO_TRACE = ("RestClient.export_session_trace: aspen builds no Perfetto traces; a session's models are jobs of the "
            "service: their steps are in `aspen status JOB`, the console and GET /v1/events on aspen's API")
NO_SEARCH = ("RestClient.search_sessions: aspen has no organisations to search; RestClient.list_sessions and "
             "get_session list your own sessions (those this server has seen since it started)")


def add_unserved_routes(router: APIRouter, user_of: Callable[..., str]) -> None:
    @router.get("/healthz")
    def healthz() -> dict:
        return types.HealthResponse(status="ok").model_dump(mode="json")

    @router.put("/sessions/{session_id}/project")
    def assign_project(session_id: str, user: str = Depends(user_of)) -> dict:
        raise HTTPException(422, f"RestClient.assign_session_project({session_id!r}): {NO_PROJECTS}")

    @router.get("/sessions/{session_id}/trace_export")
    def trace_export(session_id: str, user: str = Depends(user_of)) -> dict:
        raise HTTPException(400, NO_TRACE)

    @router.post("/sessions/search")
    def search_sessions(user: str = Depends(user_of)) -> dict:
        raise HTTPException(400, NO_SEARCH)

    @router.get("/audit")
    def audit(user: str = Depends(user_of)) -> dict:
        raise HTTPException(400, NO_AUDIT)

    @router.get("/billing/usage/events")
    def billing_usage(user: str = Depends(user_of)) -> dict:
        raise HTTPException(400, NO_BILLING)
