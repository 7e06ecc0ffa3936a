"""Sending a call to a trainer that may be busy for minutes (orchestrator/tinker/remote_calls.py's sends).

A trainer actor answers one call at a time, between its passes, and one pass may run long: a sampling of thousands
of tokens, a long step. The service then answers a call to queue work there "busy" (a 503 marked `BUSY_HEADER`,
orchestrator/tinker/tinker_service.py) and keeps the request, which the trainer still runs once its pass ends. The
user's call is not failed for it, nor sent twice: the first try answers the route at once (its errors, but busy,
are the route's), and a busy one is kept here under its token. One thread (`_wait_all`) waits for every kept call
of this front at once (the service's `ready`: one request, whatever their number) and asks for each answered one
again under its token, until the trainer answers with the call's key, or refuses it, or is lost, or has been busy
longer than `BUSY_LIMIT_S` (taken as stuck); a passing 503 (neither busy nor lost) is asked again too. So hundreds
of calls waiting on one busy trainer (an RL loop's samples) hold one thread here and one request there."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
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


@dataclass
class _Kept:
    """A call answered busy, asked for again once the service says its kept request has an answer."""

    method: str
    args: tuple[Any, ...]
    on_key: Callable[[Any], None]
    on_error: Callable[[HTTPException], None]
    since: float = field(default_factory=time.monotonic)
    detail: str = ""   # the last busy answer


class PatientSends:
    """Sends over `call(method, *args)` (the service's client) that outlast a busy trainer."""

    def __init__(self, call: Callable[..., Any]):
        self.call = call
        self.closed = threading.Event()
        self.kept: dict[str, _Kept] = {}   # by token
        self.changed = threading.Condition()
        self.waiter: threading.Thread | None = None

    def send(self, method: str, args: tuple[Any, ...], on_key: Callable[[Any], None],
             on_error: Callable[[HTTPException], None]) -> None:
        """`call(method, *args, token)`; its answer to `on_key`. An error on the first try is raised here, unless
        the trainer is busy: then the call is kept, and asked for again once answered there (`on_key`) or refused
        (`on_error`, with the service's answer)."""
        token = f"call-{uuid.uuid4().hex}"
        try:
            answer = self.call(method, *args, token)
        except HTTPException as error:
            if not is_busy(error):
                raise
            log.info("tinker: %s", error.detail)
            with self.changed:
                self.kept[token] = _Kept(method, args, on_key, on_error, detail=str(error.detail))
                if self.waiter is None or not self.waiter.is_alive():
                    self.waiter = threading.Thread(target=self._wait_all, name="tinker-busy-sends", daemon=True)
                    self.waiter.start()
                self.changed.notify_all()
            return
        on_key(answer)

    def _wait_all(self) -> None:
        while not self.closed.is_set():
            with self.changed:
                while not self.kept and not self.closed.is_set():
                    self.changed.wait()
                tokens = list(self.kept)
            if self.closed.is_set():
                return
            try:
                answered = self.call("tinker.ready", tokens)
            except HTTPException as error:   # the service's link: ask again
                log.info("tinker: waiting for calls on busy trainers: %s", error.detail)
                time.sleep(RETRY_EVERY_S)
                continue
            except Exception:   # logged; every kept call is then asked for itself (it fails with why, or waits)
                log.exception("tinker: waiting for calls on busy trainers failed")
                time.sleep(RETRY_EVERY_S)
                answered = tokens
            for token in answered:
                self._ask_again(token)
            self._fail_stuck()

    def _ask_again(self, token: str) -> None:
        with self.changed:
            kept = self.kept.get(token)
        if kept is None:
            return
        try:
            answer = self.call(kept.method, *kept.args, token)
        except HTTPException as error:
            if is_busy(error) or is_passing(error):
                kept.detail = str(error.detail)
                if not is_busy(error):
                    time.sleep(RETRY_EVERY_S)
                return   # still kept: waited for again
            self._drop(token)
            kept.on_error(error)
            return
        except Exception as error:   # the call is failed with it rather than left waiting
            log.exception("tinker: sending %s failed", kept.method)
            self._drop(token)
            kept.on_error(HTTPException(500, f"sending the call failed: {error!r}"))
            return
        self._drop(token)
        kept.on_key(answer)

    def _fail_stuck(self) -> None:
        now = time.monotonic()
        with self.changed:
            stuck = [(token, kept) for token, kept in self.kept.items() if now - kept.since > BUSY_LIMIT_S]
            for token, _ in stuck:
                del self.kept[token]
        for _, kept in stuck:
            kept.on_error(HTTPException(503, f"{kept.detail}; no answer for {BUSY_LIMIT_S:.0f}s: the trainer is "
                                             "taken as stuck (`aspen status` shows its jobs; restart it)"))

    def _drop(self, token: str) -> None:
        with self.changed:
            self.kept.pop(token, None)

    def close(self) -> None:
        self.closed.set()
        with self.changed:
            self.changed.notify_all()
