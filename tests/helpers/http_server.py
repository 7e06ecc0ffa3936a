"""The HTTP API served for a test: uvicorn in a thread on a free loopback port, and a base model no trainer
holds (a job for it stays queued)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from tests.helpers.service import wait_for

NOBODYS_MODEL = "some-org/model-nobody-holds"   # no trainer holds it: a job for it stays queued, never trains


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """uvicorn serving `app` in a thread on a free loopback port; its URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn to start", every=0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
