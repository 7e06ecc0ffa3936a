"""The HTTP API's calls to the service's Ray client: the client made on first use and made again after the
service went away (`ServiceLink`), and each call's errors as HTTP answers (`call_service`): 404 an unknown
job, 409 a conflict or a job in the wrong state, 422 an invalid spec, 429 a user's quota (with Retry-After), 503 a
service that cannot answer (or a
"try it" whose trainer stayed busy: with Retry-After, the service kept).
Used by the API in this process and by the child process that holds the Ray connection
(`orchestrator.http.bridge`)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import HTTPException

from actors.service.scheduler.call_waits import BUSY_RETRY_AFTER_S, TrainerBusy
from actors.service.scheduler.config import SCHEDULER_NAME
from orchestrator.http.request_bodies import Refused
from orchestrator.jobs_file import SpecError

log = logging.getLogger("orchestrator.http.api")   # the API's one logger, whichever module logs
T = TypeVar("T")


class ServiceLink:
    """The service's Ray client in this process (`Client.connect(address, name=name)`, or `client`): made on
    first use, dropped when the service is gone and made again on the next request (a restarted `aspen
    serve` is a new actor under the same name)."""

    def __init__(self, address: str = "auto", *, name: str = SCHEDULER_NAME, client: Any = None):
        self.address = address
        self.name = name
        self._client = client
        self._lock = threading.Lock()

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from orchestrator.client import Client

                self._client = Client.connect(self.address, name=self.name)
            return self._client

    def forget(self, client: Any) -> None:
        with self._lock:
            if self._client is client:
                self._client = None


# -- the service's errors as HTTP statuses ------------------------------------------------------------------
def _first_line(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error)


def as_http(error: Exception) -> HTTPException | None:
    """The HTTP answer for an error of a client call; None for one that is not the request's or the
    service's (a bug: 500)."""
    from ray.exceptions import RayError, RayTaskError

    from actors.service.scheduler.scheduler_core import (  # (imports torch: only here)
        QuotaExceeded,
        SubmissionConflict,
        SubmissionError,
    )
    from actors.service.table.job_table import AmbiguousJobName
    from orchestrator.errors import ServiceError

    if isinstance(error, TrainerBusy):   # the service answers; its trainer is busy: ask again later
        return HTTPException(503, str(error), headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})
    if isinstance(error, AmbiguousJobName):   # the job exists: which of several is the request's to say
        return HTTPException(409, _first_line(error))
    if isinstance(error, KeyError):
        return HTTPException(404, _first_line(error))
    if isinstance(error, SubmissionConflict):
        return HTTPException(409, str(error))
    if isinstance(error, QuotaExceeded):   # the spec is fine; the user's quota frees with time: ask again then
        if error.retry_after is None:      # a quota of 0: no wait frees it (the detail says to ask an admin)
            return HTTPException(429, str(error))
        return HTTPException(429, str(error), headers={"Retry-After": str(max(1, math.ceil(error.retry_after)))})
    if isinstance(error, (SpecError, SubmissionError)):
        return HTTPException(422, str(error))
    if isinstance(error, ValueError):          # a job in the wrong state for the request
        return HTTPException(409, str(error))
    if isinstance(error, (ServiceError, TimeoutError)) or (isinstance(error, RayError)
                                                           and not isinstance(error, RayTaskError)):
        return HTTPException(503, f"the aspen service cannot answer: {_first_line(error) or type(error).__name__}",
                             headers={"Retry-After": "5"})
    return None


def _unreachable(error: Exception) -> HTTPException:
    """503 for a client that could not be made: no Ray cluster at the address, one that refused this process
    (token authentication: `ensure_ray`'s ServiceError names the token's fix), no service on it."""
    detail = _first_line(error) or type(error).__name__
    return HTTPException(503, f"the aspen service cannot be reached: {detail}", headers={"Retry-After": "5"})


def call_service(link: ServiceLink, request: Callable[[Any], T]) -> T:
    """`request(client)`, its errors as HTTP answers; a service that is gone is connected again next time."""
    try:
        client = link.client()
    except HTTPException:   # answered already (by the Ray connection's process)
        raise
    except Exception as error:  # noqa: BLE001 - whatever stops a connection is a 503 with its reason
        answer = _unreachable(error)
        log.warning("aspen http: %s", answer.detail)
        raise answer from None
    try:
        return request(client)
    except (HTTPException, Refused):   # answered already (by the Ray connection's process, or the request's check)
        raise
    except Exception as error:  # each error is answered (or re-raised as a bug below)
        answer = as_http(error)
        if answer is None:
            raise
        if answer.status_code == 503 and not isinstance(error, TrainerBusy):   # the service may be gone
            log.warning("aspen http: %s", answer.detail)
            link.forget(client)
        raise answer from None
