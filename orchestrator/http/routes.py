"""What every router of the HTTP API shares: the link to the service, the token check that names the caller,
the audit log, and the limits on parsing bodies (orchestrator/http/api.py builds it once per app)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from actors.service.accounts.audit import AuditLog
from orchestrator.http.callers import Caller
from orchestrator.service_calls import ServiceLink

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

    def audited(self, caller: Caller, action: str, target: str, **details: Any) -> None:
        if self.audit is not None:
            self.audit.record(caller.name, action, target, **details)
