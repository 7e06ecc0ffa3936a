"""The HTTP API served for a test: uvicorn in a thread on a free loopback port, the API over a real service
(`Api`: its URL and token beside the Ray client of the same service, the reference), and a base model no
trainer holds (a job for it stays queued)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.helpers.service import wait_for

if TYPE_CHECKING:
    from orchestrator.client import Client
    from orchestrator.http.bridge import ProcessLink

NOBODYS_MODEL = "some-org/model-nobody-holds"   # no trainer holds it: a job for it stays queued, never trains
BODY_LIMIT = 64 * 1024                          # the request body limit `served_api` sets


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


@dataclass
class Api:
    url: str
    token: str
    ray: Client      # the reference: the same service through the Ray client
    base: str        # the trainer's base model (a tiny random Llama)
    link: ProcessLink
    state_dir: Path  # the service's state folder

    def table(self) -> tuple:
        """Everything a request could change: every job's row and the newest transition's number."""
        return [r.as_dict() for r in self.ray.jobs()], self.ray.transitions_after(None)[0]

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@contextlib.contextmanager
def served_api(gcs_address: str, base: str, tmp_path_factory, **settings: Any) -> Iterator[Api]:
    """A service on the session's Ray (one trainer of `base`; `settings`: further ServiceConfig fields, e.g.
    output_root) and the HTTP API over it, as `aspen http` serves it: the Ray connection in a child process
    attached to the cluster at `gcs_address`."""
    from actors.service.scheduler.config import ServiceConfig, TrainerConfig
    from orchestrator.client import Client
    from orchestrator.http.api import create_app
    from orchestrator.http.bridge import ProcessLink
    from orchestrator.http.token import ensure_token

    name = f"aspen-http-test-{uuid.uuid4().hex[:6]}"
    state_dir = tmp_path_factory.mktemp("state")
    config = ServiceConfig(state_dir=state_dir, tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1)], **settings)
    service = Client.local(config, name=name)
    token = ensure_token(tmp_path_factory.mktemp("token") / "http-token")
    # as `aspen http` serves: the Ray connection in a child process, attached to this session's cluster
    link = ProcessLink(gcs_address, name=name)
    app = create_app(link, token, max_body_bytes=BODY_LIMIT, events_poll_s=0.1)
    try:
        with running_server(app) as url:
            yield Api(url, token, service, base, link, state_dir)
    finally:
        link.close()
        service.shutdown()


def root_alice_bob(users, data_folder) -> tuple[str, str, str]:
    """The tokens of an admin ('root') and two users ('alice', 'bob') who may read `data_folder`."""
    root, _ = users.add("root", admin=True)
    alice, _ = users.add("alice", data_roots=[str(data_folder)])
    bob, _ = users.add("bob", data_roots=[str(data_folder)])
    return root, alice, bob


def write_jobs_file(path: Path, base: str, jobs: list[dict]) -> str:
    """A jobs file as a user writes it: one line per job field, its line numbers known."""
    lines = [f"base_model: {base}", "jobs:"]
    for job in jobs:
        first, *rest = job.items()
        lines.append(f"  - {first[0]}: {json.dumps(first[1])}")
        lines += [f"    {key}: {json.dumps(value)}" for key, value in rest]
    path.write_text("\n".join(lines) + "\n")
    return path.read_text()
