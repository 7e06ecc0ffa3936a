"""Sending a call to a trainer that may be busy for minutes (orchestrator/tinker/remote_calls.py's sends).

A trainer actor answers one call at a time, between its passes, and one pass may run long: a sampling of thousands
of tokens, a long step. The service then answers a call to queue work there "busy" (a 503 marked `BUSY_HEADER`,
orchestrator/tinker/tinker_service.py) and keeps the request, which the trainer still runs once its pass ends. The
user's call is not failed for it, nor sent twice: the first try answers the route at once (its errors, but busy,
are the route's), and a busy one goes on in a thread of its own, asking the service again under the same token
(the same request waited on again) until the trainer answers with the call's key, or refuses it, or is lost, or has
been busy longer than `BUSY_LIMIT_S` (taken as stuck); a passing 503 (neither busy nor lost) is asked again too.
Each waiting call holds a thread of the process holding the Ray connection for up to 10 s an ask: hundreds of
calls waiting at once on one busy trainer queue behind each other there (noted, not solved)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from orchestrator.tinker.tinker_service import BUSY_HEADER, LOST_HEADER

log = logging.getLogger(__name__)

BUSY_LIMIT_S = 1800.0   # a trainer busy in one pass longer than this is taken as stuck: its waiting calls fail
RETRY_EVERY_S = 1.0     # between asks after a passing 503 (the service's link, not the trainer)


def is_busy(error: HTTPException) -> bool:
    """Whether the service answered that the call's trainer is alive and in a long pass."""
    return BUSY_HEADER in (error.headers or {})


def category(error: HTTPException) -> str:
    """Whose a refusal is: the user's call (4xx) or the server's."""
    return "user" if 400 <= error.status_code < 500 else "server"


def is_passing(error: HTTPException) -> bool:
    """A 503 that is neither a busy nor a lost trainer (the service's link, a restart): the same request is asked
    for again (the call may be queued on the trainer already: failing it would drop a call that runs)."""
    return error.status_code == 503 and LOST_HEADER not in (error.headers or {})


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
        since = time.monotonic()
        while not self.closed.is_set():
            try:
                answer = self.call(method, *args, token)
            except HTTPException as error:
                if time.monotonic() - since > BUSY_LIMIT_S:
                    on_error(HTTPException(503, f"{error.detail}; no answer for {BUSY_LIMIT_S:.0f}s: the trainer is "
                                                "taken as stuck (`aspen status` shows its jobs; restart it)"))
                    return
                if is_busy(error):
                    continue   # the service waited on the same request for a while: ask again
                if is_passing(error):
                    time.sleep(RETRY_EVERY_S)
                    continue
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
