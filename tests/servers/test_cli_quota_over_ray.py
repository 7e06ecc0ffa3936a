"""A quota refusal told by the real `aspen` CLI in a subprocess, over Ray (`--address`, the Ray client: the
scheduler's own QuotaExceeded) as over HTTP (`--url`, the reference: a 429): exit 4, the same one line (less the
HTTP status), nothing queued. A real service on the session's Ray under the name the CLI looks for, with its
users file and the HTTP API over it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.accounts.users import UserBook
from actors.service.scheduler.config import SCHEDULER_NAME
from orchestrator.client import Client
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import HttpClient
from orchestrator.http.token import ensure_token
from tests.helpers.http_server import NOBODYS_MODEL, running_server
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, write_task_data

REPO = Path(__file__).resolve().parents[2]
EXIT_QUOTA = 4


def aspen(*args: str, token: str) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, as alice (her token for --url; --address takes none)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": token}, timeout=300)


@pytest.mark.long   # a service of its own and six CLI processes (each imports the package): ~60 s
def test_a_quota_refusal_over_ray_exits_4_with_the_line_said_over_http(ray_session, tiny_model_dirs, tmp_path):
    """alice (quota queued=1) cancelled a job and has another queued: resuming or extending the first is refused by
    her quota. `aspen resume` / `aspen extend` over HTTP exit 4 with one line; over Ray, the same exit and the same
    line (without "(HTTP 429)"), not exit 2 as for a usage error; the job stays cancelled (the Ray client's
    record)."""
    state_dir = tmp_path / "state"
    data = write_task_data(tmp_path / "data", "quota")
    service = Client.local(service_config(state_dir, tiny_model_dirs["llama"], listeners=NO_LISTENERS),
                           name=SCHEDULER_NAME)   # the name `aspen ... --address` looks for
    users = UserBook.in_state_dir(state_dir)
    alice, _ = users.add("alice", data_roots=[str(data.parent)], quotas={"queued": 1})
    address = ray_session.get_runtime_context().gcs_address
    try:
        app = create_app(ServiceLink(client=service), ensure_token(tmp_path / "http-token"), users=users)
        with running_server(app) as url:
            as_alice = HttpClient(url, alice)
            first = as_alice.submit(job_dict("first", data, 5), base_model=NOBODYS_MODEL)   # queued, never trains
            as_alice.cancel(first.id)
            other = as_alice.submit(job_dict("other", data, 5), base_model=NOBODYS_MODEL)   # her one queued job
            for command in (["resume", first.id], ["extend", first.id, "--max-steps", "10"]):
                over_http = aspen(*command, "--url", url, token=alice)
                assert over_http.returncode == EXIT_QUOTA, (command, over_http.returncode, over_http.stderr)
                (line,) = over_http.stderr.strip().splitlines()
                assert line.startswith("aspen: over your quota: ") and "user alice: quota queued=1" in line, line
                assert "(HTTP 429)" in line, line
                over_ray = aspen(*command, "--address", address, token=alice)
                assert over_ray.returncode == EXIT_QUOTA, (command, over_ray.returncode, over_ray.stderr)
                assert over_ray.stderr.strip().splitlines() == [line.replace(" (HTTP 429)", "")], over_ray.stderr
                assert service.status(first.id).state == "cancelled"
            as_alice.cancel(other.id)
    finally:
        service.shutdown()
