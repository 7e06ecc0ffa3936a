"""The HTTP API server's Ray connection, kept in a child process (`RayBridge`), so that the server itself
never joins Ray: a Ray driver ends its own process when its cluster goes away (Ray 2.60: "Failed to connect
to GCS within 60 seconds ... The program will terminate"), and `aspen http` must outlive that, answer 503
meanwhile, and reach the service again once a cluster runs. The child is a Ray driver holding a
`ServiceLink` (connected on first use, again after the service went away); the server sends it client
calls over a pipe (several at once, each with its number) and gets back the result or the HTTP answer for
the error. When the child dies, the calls in flight are answered 503 and the next call starts a new one.

Messages cross the pipe pickled by value (`send` / `receive`), not by multiprocessing's own pickler: with
torch imported, that one moves a tensor into shared memory and passes its file descriptor through a
listener socket in a `pymp-*` folder of the sender's, which the child, leaving by `os._exit`, never removed
(two folders left in /tmp by each run of tests/service/test_tinker_service.py).

    link = ProcessLink(address="auto")        # what `aspen http` serves through
    create_app(link, token)"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from functools import reduce
from typing import Any

from fastapi import HTTPException

from actors.service.scheduler.call_waits import SCHEDULER_CALL_WAIT_S

log = logging.getLogger(__name__)

# longer than a client call waits for a busy service (orchestrator.scheduler_calls._call), so that its answer
# (a "try it"'s busy trainer included: actors/service/scheduler/call_waits.py) arrives first
CALL_TIMEOUT_S = SCHEDULER_CALL_WAIT_S + 30.0
BRIDGE_THREADS = 16
GCS_RECONNECT_S = 15


def send(connection: Any, message: Any) -> None:
    """`message` pickled by value (a tensor's bytes in the message: no shared memory, no descriptor passing)."""
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Any) -> Any:
    """What `send` sent (only this process's own pipe to its bridge: nothing from outside is unpickled)."""
    return pickle.loads(connection.recv_bytes())


def _bridge_main(connection: Any, address: str, name: str, env: dict[str, str]) -> None:
    """The child: run each call `(number, method, args)` on the service's client, answer `(number, kind,
    value)`: kind "ok" (the result), "http" (status, detail, headers) or "bug" (a traceback)."""
    os.environ.update(env)
    # a driver whose cluster is gone ends its process after this long (Ray's default: 60 s, while every call
    # waits): sooner here, so that the server answers 503 and connects again sooner
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_RECONNECT_S))
    from orchestrator.service_calls import ServiceLink, call_service

    link = ServiceLink(address, name=name)
    sending = threading.Lock()

    def run(number: int, method: str, args: tuple) -> None:
        import ray

        try:
            # a dotted name reaches a client's part (`tinker.submit`: orchestrator/tinker/tinker_service.py)
            answer: tuple = ("ok", call_service(link, lambda client: reduce(getattr, method.split("."), client)(*args)))
        except HTTPException as error:
            answer = ("http", (error.status_code, error.detail, dict(error.headers or {})))
        except Exception:  # noqa: BLE001 - a bug: its traceback goes back to the server (a 500)
            answer = ("bug", traceback.format_exc())
        with sending:
            send(connection, (number, *answer))
            if answer[0] == "http" and answer[1][0] == 503 and not ray.is_initialized():
                # ray.init failed halfway: a later one in this process can hang; the next call starts afresh
                os._exit(3)

    with ThreadPoolExecutor(BRIDGE_THREADS, thread_name_prefix="aspen-http-call") as pool:
        while True:
            try:
                message = receive(connection)
            except (EOFError, OSError):   # the server is gone
                break
            if message is None:           # the server closes the bridge
                break
            pool.submit(run, *message)
    os._exit(0)   # not Ray's shutdown hooks: the driver leaves with its process


class RayBridge:
    """One child process holding the Ray connection; `call(method, *args)` runs the client's method there."""

    def __init__(self, address: str, name: str, env: dict[str, str] | None = None):
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_bridge_main, args=(child, address, name, env or {}),
                                       name="aspen-http-ray", daemon=True)
        self.process.start()
        child.close()
        self.numbers = itertools.count()
        self.pending: dict[int, Future] = {}
        self.lock = threading.Lock()
        self.alive = True
        self.closing = False
        self.reader = threading.Thread(target=self._read, name="aspen-http-bridge-reader", daemon=True)
        self.reader.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _read(self) -> None:
        while True:
            try:
                number, kind, value = receive(self.connection)
            except (EOFError, OSError):
                break
            with self.lock:
                future = self.pending.pop(number, None)
            if future is not None:
                future.set_result((kind, value))
        with self.lock:
            self.alive = False
            pending, self.pending = self.pending, {}
        self.process.join(timeout=5)
        why = (f"the process holding the Ray connection exited (code {self.process.exitcode}; the Ray cluster went "
               "away?); the next request connects again")
        if not self.closing:
            log.warning("aspen http: %s", why)
        for future in pending.values():
            future.set_result(("http", (503, why, {"Retry-After": "5"})))

    def call(self, method: str, *args: Any) -> Any:
        future: Future = Future()
        with self.lock:
            if not self.alive:
                raise HTTPException(503, "the process holding the Ray connection has exited; try again",
                                    headers={"Retry-After": "1"})
            number = next(self.numbers)
            self.pending[number] = future
            send(self.connection, (number, method, args))
        try:
            kind, value = future.result(timeout=CALL_TIMEOUT_S)
        except TimeoutError:
            with self.lock:
                self.pending.pop(number, None)
            raise HTTPException(503, f"the aspen service did not answer {method} within {CALL_TIMEOUT_S:.0f}s",
                                headers={"Retry-After": "5"}) from None
        if kind == "ok":
            return value
        if kind == "http":
            status, detail, headers = value
            raise HTTPException(status, detail, headers=headers or None)
        raise RuntimeError(f"the Ray connection process failed on {method}:\n{value}")

    def close(self) -> None:
        with self.lock:
            self.closing = True
            if self.alive:
                self.alive = False
                try:
                    send(self.connection, None)
                except OSError:
                    pass   # it has exited already
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.connection.close()


class _BridgedClient:
    """The service's client as the app uses it (`client.jobs()`, `client.status(job)`, ...), over a bridge."""

    def __init__(self, bridge: RayBridge):
        self._bridge = bridge

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self._bridge.call(method, *args)


class ProcessLink:
    """A `ServiceLink` whose Ray connection lives in a child process (`RayBridge`), started on first use and
    again after it died. `env`: extra environment for the child (e.g. RAY_AUTH_MODE)."""

    def __init__(self, address: str = "auto", *, name: str | None = None, env: dict[str, str] | None = None):
        from actors.service.scheduler.config import SCHEDULER_NAME

        self.address = address
        self.name = name or SCHEDULER_NAME
        self.env = env or {}
        self.bridge: RayBridge | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.bridge.pid if self.bridge is not None else None

    def client(self) -> _BridgedClient:
        with self._lock:
            if self.bridge is None or not self.bridge.alive:
                self.bridge = RayBridge(self.address, self.name, self.env)
            return _BridgedClient(self.bridge)

    def forget(self, client: Any) -> None:
        """Nothing to forget here: the child reconnects to the service itself; a dead child is replaced."""

    def close(self) -> None:
        with self._lock:
            if self.bridge is not None:
                self.bridge.close()
                self.bridge = None
