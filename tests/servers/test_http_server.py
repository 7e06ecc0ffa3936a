"""`aspen http` and what it stands on, on real servers: the command as a user starts it (a generated private
token, loopback, a prompt stop on SIGTERM), the token file, the Ray connection in a child process replaced when
it dies, a server with no service behind it (503s, still up), and the Ray-free client and CLI (`--url`) against
a real service, checked against the Ray client's view of it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import HttpClient
from orchestrator.http.token import TokenFileError, client_token, ensure_token, read_token
from tests.helpers.http_server import running_server
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, wait_for, write_task_data

REPO = Path(__file__).resolve().parents[2]


def test_a_service_that_does_not_answer_is_a_503_and_the_server_stays_up(ray_session, tmp_path):
    token = ensure_token(tmp_path / "token")
    app = create_app(ServiceLink(name=f"aspen-nobody-{uuid.uuid4().hex[:6]}"), token)
    with running_server(app) as url:
        for _ in range(2):   # the server answers again (and tries to connect again) after a failure
            response = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 503 and "no aspen service" in response.json()["detail"], response.text
            assert response.headers["retry-after"] == "5"
        health = httpx.get(f"{url}/v1/health")
        assert health.status_code == 503 and health.json()["service"] == "unavailable"
        assert httpx.get(f"{url}/v1/jobs").status_code == 401   # the token is checked first


def test_the_http_client_and_the_cli_with_url_need_no_ray(api, tmp_path):
    """`aspen submit/status/losses/cancel --url` in a fresh process: it works, and Ray is never imported."""
    data = write_task_data(tmp_path / "data", "cli")
    (tmp_path / "jobs.yaml").write_text(json.dumps({"base_model": api.base, "output_dir": "out", "jobs": [
        {**job_dict("cli-http", Path("data/cli.jsonl"), 2)}]}))   # relative: taken from the file's folder
    script = ("import sys, orchestrator.http.api_client; assert not {'ray', 'torch'} & set(sys.modules), 'imported'; "
              "from orchestrator.cli import main; code = main(sys.argv[1:]); "
              "assert 'ray' not in sys.modules, 'ray was imported'; sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASPEN_URL": api.url, "ASPEN_TOKEN": api.token}

    def aspen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    submitted = aspen("submit", "jobs.yaml", "--json")
    assert submitted.returncode == 0, submitted.stderr
    (job,) = json.loads(submitted.stdout)
    assert job["name"] == "cli-http"
    assert api.ray.submission(job["id"]).job.data == data            # the file's relative path, resolved
    assert api.ray.status(job["id"]).output_dir == str(tmp_path / "out" / "cli-http")
    assert api.ray.wait(job["id"], timeout=120).state == "completed"
    losses = aspen("losses", job["id"], "--json")
    assert losses.returncode == 0, losses.stderr
    assert json.loads(losses.stdout) == api.ray.losses(job["id"])
    listed = aspen("status", "--json", "--url", api.url)
    assert listed.returncode == 0, listed.stderr
    assert job["id"] in [r["id"] for r in json.loads(listed.stdout)]
    exported = aspen("export", "cli-http", "--out", "cli-lora", "--json")   # through the API: its owner's adapter
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["folder"] == "cli-lora"
    assert (tmp_path / "cli-lora" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "out" / "cli-http" / "adapter_model.safetensors").read_bytes()
    refused = aspen("cancel", job["id"])
    assert refused.returncode == 2 and "already ended" in refused.stderr and "(HTTP 409)" in refused.stderr


def test_the_token_file_is_private_generated_once_and_read_by_clients(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main

    path = tmp_path / "aspen" / "http-token"
    token = ensure_token(path)
    assert len(token) >= 43 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token == read_token(path)
    assert main(["http-token", "--token-file", str(path)]) == 0
    assert capsys.readouterr().out.strip() == token
    monkeypatch.delenv("ASPEN_TOKEN", raising=False)
    monkeypatch.setenv("ASPEN_TOKEN_FILE", str(path))
    assert client_token() == token
    monkeypatch.setenv("ASPEN_TOKEN", "from-the-environment")
    assert client_token() == "from-the-environment"
    rotated = ensure_token(path, rotate=True)
    assert rotated != token and read_token(path) == rotated
    path.chmod(0o644)
    with pytest.raises(TokenFileError, match="readable by other users"):
        read_token(path)
    with pytest.raises(TokenFileError, match="no HTTP API token"):
        read_token(tmp_path / "missing")


def test_the_ray_connection_lives_in_a_child_process_replaced_when_it_dies(api):
    """The server never joins Ray (a driver dies with its cluster); its Ray connection's process does, and a
    new one serves the next request."""
    http = HttpClient(api.url, api.token)
    assert http.jobs() == api.ray.jobs()
    first = api.link.pid
    assert first is not None and first != os.getpid()
    os.kill(first, 9)
    wait_for(lambda: not api.link.bridge.alive, timeout=10, what="the server to notice")
    assert http.jobs() == api.ray.jobs()
    assert api.link.pid not in (None, first)


def test_aspen_http_serves_on_loopback_with_a_generated_token_and_stops_on_sigterm(ray_session, tmp_path):
    """`aspen http` as a user starts it: a token file made for it (0600), loopback, 401 without the token, a 503
    naming the missing service (none runs under the default name here), and a prompt stop."""
    from orchestrator.http.api import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    port = free_port()
    token_path = tmp_path / "token"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "http", "--port", str(port), "--address",
                               ray_session.get_runtime_context().gcs_address, "--token-file", str(token_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/openapi.json", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, timeout=60, what="`aspen http` to answer", every=0.2)
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        token = read_token(token_path)
        assert httpx.get(f"{url}/v1/jobs").status_code == 401
        response = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert response.status_code == 503 and "no aspen service ('aspen-scheduler'" in response.json()["detail"]
        # the CLI over the API: the service missing behind the server is a runtime failure (exit 1)
        status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--url", url],
                                env={**env, "ASPEN_TOKEN": token}, capture_output=True, text=True, timeout=120)
        assert status.returncode == 1 and "no aspen service" in status.stderr, status.stderr
        server.terminate()
        output, _ = server.communicate(timeout=30)
        assert server.returncode in (0, -signal.SIGTERM), output   # uvicorn re-raises the signal once stopped
        assert "Finished server process" in output
        assert f"aspen HTTP API on http://127.0.0.1:{port}" in output and str(token_path) in output
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
