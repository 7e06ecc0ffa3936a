"""The HTTP API's service routes: the service's description, who the token is, the users' accounts, the
audit log (admins only)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query

from orchestrator.http.callers import Caller, visible, visible_info
from orchestrator.http.responses import ErrorBody
from orchestrator.http.routes import Routes, operation_route
from orchestrator.service_calls import call_service


def add_service_routes(api: APIRouter, ctx: Routes) -> None:
    link, require_token, audit = ctx.link, ctx.require_token, ctx.audit

    @operation_route(api, "info", tags=["service"])
    def service_info(caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """The service's description: state folder, policy, output root, trainers, metrics and events URLs. A
        trainer's jobs (and their tokens in its last step) are yours only (an admin: everyone's)."""
        def described(client: Any) -> dict[str, Any]:
            info = client.info()
            if caller.admin:
                return info
            held = client.jobs(("queued", "running", "paused"))   # a trainer holds only unfinished jobs
            return visible_info(info, {record.id for record in visible(held, caller)})

        return call_service(link, described)

    @operation_route(api, "whoami", tags=["service"])
    def whoami(caller: Caller = Depends(require_token)) -> dict[str, Any]:
        """Who the token is: `{"name", "admin"}` (the console shows an admin everyone's jobs and a user filter)."""
        return {"name": caller.name, "admin": caller.admin}

    @operation_route(api, "accounts", tags=["service"])
    def accounts(caller: Caller = Depends(require_token)) -> Any:
        """What each user's jobs used, summed over the fused steps they took part in: jobs, trained tokens,
        step-seconds (their share of each step's time by their tokens) and GPU-seconds. Yours only (an admin:
        every user's; user null: jobs submitted through Ray)."""
        rows = call_service(link, lambda client: client.accounts())
        return [row for row in rows if caller.admin or row["user"] == caller.name]

    @operation_route(api, "audit", tags=["service"],
                     responses={403: {"model": ErrorBody, "description": "not an admin"}})
    def audit_rows(user: str | None = Query(None, description="only this user's actions"),
                   after: float | None = Query(None, description="only actions after this time (seconds since "
                                                                 "the epoch)"),
                   caller: Caller = Depends(require_token)) -> Any:
        """The audit log (admins only): one row per action (time, user, action, target, details), oldest first."""
        if not caller.admin:
            raise HTTPException(403, "the audit log is for admins (`aspen user add NAME --admin`)")
        if audit is None:
            return []
        return audit.rows(user=user, after=after)
