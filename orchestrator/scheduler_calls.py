"""A call to the service's scheduler actor as the client makes it: Ray's answer, with the service's own error
raised in place of Ray's wrapper (`_call`), and the reason a scheduler that could not start gave
(`_init_failure`)."""

from __future__ import annotations

import re
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.service.scheduler.call_waits import SCHEDULER_CALL_WAIT_S, TrainerBusy
from orchestrator.errors import ServiceError


def _call(ref: ray.ObjectRef, timeout: float | None = SCHEDULER_CALL_WAIT_S) -> Any:
    """`ray.get`, with the service's own error (not Ray's wrapper) raised: a bad request as ValueError /
    KeyError with the service's message, a "try it" whose trainer is busy as TrainerBusy, a service that
    cannot act now (its job table is locked, its state dir in use) as ServiceError. `timeout`: by default
    longer than the service's own longest wait (actors/service/scheduler/call_waits.py), so that its answer
    arrives first."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, TrainerBusy):   # the service's answer: its trainer is busy, the service is not
            raise TrainerBusy(str(cause)) from None
        if isinstance(cause, (KeyError, ValueError)):
            message = cause.args[0] if cause.args else str(cause)
            own = type(cause)(message)
            own.__dict__.update(vars(cause))   # its fields too (a quota refusal's retry_after, a folder)
            raise own from None
        if isinstance(cause, (RuntimeError, TimeoutError, OSError)) and not isinstance(cause, RayActorError):
            raise ServiceError(str(cause)) from None
        raise
    except GetTimeoutError:
        raise ServiceError(f"the aspen service did not answer within {timeout:.0f}s; it may be busy or stuck "
                           f"(see its log: the Ray dashboard, or {_logs_dir()})") from None


def _logs_dir() -> str:
    """The connected cluster's log folder (under `ray start --temp-dir`, not /tmp/ray), where the driver knows it."""
    node = getattr(getattr(ray._private.worker, "global_worker", None), "node", None)
    folder = getattr(node, "get_logs_dir_path", None)
    return folder() if callable(folder) else "/tmp/ray/session_latest/logs (Ray's default temp dir)"


def _init_failure(error: RayActorError) -> str:
    """The last line of the scheduler's constructor error (Ray's message around it is long)."""
    text = str(getattr(error, "error_msg", "") or error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    # the service's own errors say everything in their message: `actors.x.JobTableDamaged: ...` without the name
    return re.sub(r"^actors(\.\w+)+: ", "", lines[-1])
