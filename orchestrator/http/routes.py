"""What every router of the HTTP API shares: the link to the service, the token check that names the caller,
the audit log, and the limits on parsing bodies and reading their data rows (orchestrator/http/api.py builds it
once per app)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI

from actors.service.accounts.audit import AuditLog
from orchestrator.http.callers import Caller
from orchestrator.http.data_rows import ROW_CHECK_THREADS
from orchestrator.service_calls import ServiceLink
from orchestrator.service_operations import by_name

PARSE_THREADS = 2            # bodies parsed at once (each within http/request_bodies.BODY_LIMITS); more wait their turn


@dataclass
class Routes:
    link: ServiceLink
    require_token: Callable[..., Caller]     # the FastAPI dependency: the caller, or a 401
    audit: AuditLog | None
    events_poll_s: float
    body_schema: dict[str, Any]              # the request body's schema of POST /v1/jobs
    submit_lock: threading.Lock = field(default_factory=threading.Lock)   # a name check and its submission: one step
    parsers: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(PARSE_THREADS))
    row_checks: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(ROW_CHECK_THREADS))

    def audited(self, caller: Caller, action: str, target: str, **details: Any) -> None:
        if self.audit is not None:
            self.audit.record(caller.name, action, target, **details)


def operation_route(router: APIRouter | FastAPI, name: str, **options: Any) -> Callable[[Callable], Callable]:
    """The decorator of the catalogued operation `name`'s route (orchestrator/service_operations.py): its method,
    its path (under the router's prefix) and its response model come from the catalogue; `options` add the
    rest (status code, tags, the refusals it may answer)."""
    operation = by_name()[name]
    if operation.http is None:
        raise ValueError(f"operation '{name}' has no HTTP route in orchestrator/service_operations.py")
    method, path = operation.http
    prefix = getattr(router, "prefix", "")
    if not path.startswith(prefix):
        raise ValueError(f"operation '{name}': {path} is not under the router's prefix {prefix}")
    if operation.response is not None:
        options.setdefault("response_model", operation.response)
    return router.api_route(path.removeprefix(prefix), methods=[method], **options)
