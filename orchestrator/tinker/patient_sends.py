"""Sending a call to a trainer that may be busy for minutes (orchestrator/tinker/remote_calls.py's sends).

A trainer actor answers one call at a time, between its passes, and one pass may run long: a sampling of thousands
of tokens, a long step. The service then answers a call to queue work there "busy" (a 503 marked `BUSY_HEADER`,
orchestrator/tinker/tinker_service.py) and keeps the request, which the trainer still runs once its pass ends. The
user's call is not failed for it, nor sent twice: the first try answers the route at once (its errors, but busy,
are the route's), and a busy one goes on in a thread of its own, asking the service again under the same token
(the same request waited on again) until the trainer answers with the call's key, or refuses it, or is lost."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from orchestrator.tinker.tinker_service import BUSY_HEADER

log = logging.getLogger(__name__)


def is_busy(error: HTTPException) -> bool:
    """Whether the service answered that the call's trainer is alive and in a long pass."""
    return BUSY_HEADER in (error.headers or {})


class PatientSends:
    """Sends over `call(method, *args)` (the service's client) that outlast a busy trainer."""

    def __init__(self, call: Callable[..., Any]):
        self.call = call
        self.closed = threading.Event()

    def send(self, method: str, args: tuple[Any, ...], on_key: Callable[[Any], None],
             on_error: Callable[[HTTPException], None]) -> None:
        """`call(method, *args, token)`; its answer to `on_key`. An error on the first try is raised here, unless
        the trainer is busy: then the call is asked for again in a thread until answered (`on_key`) or refused
        (`on_error`, with the service's answer)."""
        token = f"call-{uuid.uuid4().hex}"
        try:
            answer = self.call(method, *args, token)
        except HTTPException as error:
            if not is_busy(error):
                raise
            log.info("tinker: %s", error.detail)
            threading.Thread(target=self._until_answered, args=(method, args, token, on_key, on_error),
                             name=f"tinker-send-{token[5:17]}", daemon=True).start()
            return
        on_key(answer)

    def _until_answered(self, method: str, args: tuple[Any, ...], token: str, on_key: Callable[[Any], None],
                        on_error: Callable[[HTTPException], None]) -> None:
        while not self.closed.is_set():
            try:
                answer = self.call(method, *args, token)
            except HTTPException as error:
                if is_busy(error):
                    continue   # the service waited on the same request for a while: ask again
                on_error(error)
                return
            except Exception as error:   # the call is failed with it rather than left waiting
                log.exception("tinker: sending %s failed", method)
                on_error(HTTPException(500, f"sending the call failed: {error!r}"))
                return
            on_key(answer)
            return

    def close(self) -> None:
        self.closed.set()
