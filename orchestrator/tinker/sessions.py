"""The Tinker API's sessions and futures, server side: a session per SDK `ServiceClient` (its user, its
heartbeats, its models `<session>:train:<n>`), and a future per accepted call (`request_id`), which
`retrieve_future` waits on for at most a long poll before answering "try again" (the SDK polls without
pausing, so the server holds each poll instead)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_TIMEOUT_S = 180.0   # a session that has not beaten for this long has ended (the SDK beats every 10 s)
LONG_POLL_S = 20.0            # a retrieve_future waits this long before "try again" (the SDK reads for 45 s)


@dataclass
class Session:
    session_id: str
    user: str
    last_beat: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)   # its sampling sessions' ids
    ended: bool = False
    user_metadata: dict[str, str] | None = None          # as its create_session gave them
    display_name: str | None = None
    losses: dict[str, Any] = field(default_factory=dict)  # its custom losses (CustomLoss) by loss_id


class Unknown(KeyError):
    """A session or request this server does not hold for the user; its message as given (a KeyError's str quotes
    it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Cancelled(Exception):
    """A sampling request its client cancelled: before it ran, or while it ran (its answer dropped)."""

    category = "user"


@dataclass
class Accepted:
    """A call's future and how its result becomes the answer (a dict of JSON, or protobuf bytes)."""

    future: Future
    user: str
    answer: Callable[[Any], dict | bytes]
    cancellable: bool = False   # a sampling call: its client may abandon it (cancel_future)
    started: bool = False       # cancelled when it had started on its trainer: it ran on, its answer dropped


class Sessions:
    """Every session and every accepted call's future, by id."""

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sessions: dict[str, Session] = {}
        self.futures: dict[str, Accepted] = {}
        self.lock = threading.Lock()

    def open(self, user: str, user_metadata: dict[str, Any] | None = None, display_name: str | None = None) -> Session:
        metadata = None if user_metadata is None else {str(key): str(value) for key, value in user_metadata.items()}
        session = Session(f"aspen-{uuid.uuid4().hex[:12]}", user, user_metadata=metadata, display_name=display_name)
        with self.lock:
            self.sessions[session.session_id] = session
        return session

    def get(self, session_id: str, user: str) -> Session:
        """The user's live session; KeyError for another user's, an unknown or an ended one."""
        with self.lock:
            session = self.sessions.get(session_id)
        if session is None or session.user != user or session.ended:
            raise Unknown(self.no_session(session_id))
        return session

    def no_session(self, session_id: str) -> str:
        return (f"no session {session_id} of yours on this server (sessions live in the HTTP server that opened "
                f"them: one restarted since knows none, and one closed or silent for {self.heartbeat_timeout_s:.0f}s "
                "has ended; create a new ServiceClient, its models from a saved state where needed)")

    def find(self, session_id: str, user: str) -> Session:
        """The user's session, live or ended (while this server runs); KeyError for another user's or an unknown."""
        with self.lock:
            session = self.sessions.get(session_id)
        if session is None or session.user != user:
            raise Unknown(self.no_session(session_id))
        return session

    def of(self, user: str) -> list[Session]:
        """The user's sessions this server has seen since it started, the newest first."""
        with self.lock:
            return [session for session in reversed(self.sessions.values()) if session.user == user]

    def every(self) -> list[Session]:
        """Every user's sessions this server has seen since it started, the newest first."""
        with self.lock:
            return list(reversed(self.sessions.values()))

    def beat(self, session_id: str, user: str) -> None:
        self.get(session_id, user).last_beat = time.monotonic()

    def expired(self) -> list[Session]:
        """Sessions that stopped beating, marked ended (their models are to be closed)."""
        now = time.monotonic()
        with self.lock:
            gone = [s for s in self.sessions.values() if not s.ended and now - s.last_beat > self.heartbeat_timeout_s]
            for session in gone:
                session.ended = True
        return gone

    def accept(self, future: Future, user: str, answer: Callable[[Any], dict | bytes], *,
               cancellable: bool = False) -> str:
        request_id = f"req-{uuid.uuid4().hex}"
        with self.lock:
            self.futures[request_id] = Accepted(future, user, answer, cancellable)
        return request_id

    def cancel(self, request_id: str, user: str,
               on_trainer: Callable[[Future], bool | None] | None = None) -> Future:
        """Cancel the user's sampling request where its answer has not come; the future either way, which then
        answers "cancelled": before it ran, or while it ran (its answer dropped). `on_trainer`: on a service, the
        cancel on its trainer (RemoteCalls.cancel), asked first: False, it had started there. KeyError for another
        user's or an unknown request, ValueError for one that is not a sampling request (a model's calls run in
        order: none may be dropped)."""
        with self.lock:
            accepted = self.futures.get(request_id)
        if accepted is None or accepted.user != user:
            raise Unknown(f"no request {request_id} of yours on this server (requests live in the HTTP server that "
                          "took them: one restarted since knows none; send the call again from a new ServiceClient)")
        if not accepted.cancellable:
            raise ValueError(f"request {request_id} is not a sampling request; only those can be cancelled")
        dropped = None if on_trainer is None else on_trainer(accepted.future)
        accepted.started = dropped is False
        accepted.future.cancel()
        if dropped is None and on_trainer is not None:   # sent meanwhile, after its send looked for a cancel
            on_trainer(accepted.future)
        return accepted.future

    async def retrieve(self, request_id: str, user: str, wait_s: float = LONG_POLL_S) -> tuple[str, Any]:
        """("done", answer), ("failed", error) or ("pending", None) after waiting at most `wait_s`."""
        with self.lock:
            accepted = self.futures.get(request_id)
        if accepted is None or accepted.user != user:
            raise Unknown(f"no request {request_id} of yours on this server (requests live in the HTTP server that "
                          "took them: one restarted since knows none; send the call again from a new ServiceClient)")
        cancelled = Cancelled(f"request {request_id} was cancelled (cancel_future) " + (
            "while it ran on its trainer: it ran to its end there, and its answer was dropped" if accepted.started
            else "before it ran"))
        if accepted.future.cancelled():
            return "failed", cancelled
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(accepted.future)), wait_s)
        except TimeoutError:
            return "pending", None
        except asyncio.CancelledError:
            if accepted.future.cancelled():   # cancelled (cancel_future) while this poll waited: answered as after it
                return "failed", cancelled
            raise   # this request itself was cancelled (its client left, the server stops)
        except Exception as error:  # noqa: BLE001 - the call failed: its error is the answer
            return "failed", error
        try:
            return "done", accepted.answer(result)
        except Exception as error:  # noqa: BLE001 - its answer cannot be made (answers.py): the call failed so
            return "failed", error
