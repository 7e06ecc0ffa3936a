"""`ray job submit` against a real head node set up as the README says on a fresh machine (an empty HOME:
`ray get-auth-token --generate`, then `ray start --head`, so Ray's token authentication is on): `aspen run`
as the job's entry point, and `aspen serve` followed by `aspen submit` to the running service. And a head
started open (no token generated): `aspen serve` refuses it unless given --insecure.

Every head started here is stopped by its process session (never `ray stop`, which would stop every Ray
on the machine)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.ray_nodes import BIN, plain_env, start_head, stop_head
from tests.helpers.service import write_task_data


@pytest.fixture(scope="module")
def client_home(tmp_path_factory) -> Path:
    """HOME of every client command here: empty, so the token reaches them only by RAY_AUTH_TOKEN."""
    return tmp_path_factory.mktemp("client-home")


@pytest.fixture(scope="module")
def head(client_home) -> Iterator[dict]:
    started = start_head(token=True)
    try:
        yield {**started, "client_home": client_home}
    finally:
        stop_head(started)


def with_token(head: dict) -> dict[str, str]:
    return {**plain_env(head["client_home"]), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"]}


def write_working_dir(folder: Path, base: Path, output_dir: Path, steps: int = 3) -> Path:
    write_task_data(folder / "data", "alpha")
    write_task_data(folder / "data", "beta", offset=4)
    jobs = {"base_model": str(base), "output_dir": str(output_dir), "step_tokens": 512, "jobs": [
        {"name": name, "data": f"data/{name}.jsonl", "max_steps": steps, "batch_size": 4, "max_seq_len": 128,
         "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
         "lora": {"r": 4, "alpha": 8}} for name in ("alpha", "beta")]}
    (folder / "jobs.yaml").write_text(json.dumps(jobs, indent=1))  # JSON is YAML
    return folder


def ray_job_submit(head: dict, working_dir: Path, *entrypoint: str, token: bool = True):
    """`ray job submit`, submitted again while the head's job agent is still starting (a loaded machine
    can take tens of seconds after the dashboard answers), as Ray's own message asks."""
    env = with_token(head) if token else plain_env(head["client_home"])
    deadline = time.time() + 120
    while True:
        result = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", head["dashboard"],
                                 "--working-dir", str(working_dir), "--", *entrypoint], env=env,
                                capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in result.stderr + result.stdout or time.time() > deadline:
            return result
        time.sleep(3)


def test_cluster_auth_decides_by_the_cluster_not_the_worker_alone():
    """A GCS that answers a request without a token is open, whatever the worker's own mode says; the
    worker's mode decides only where that probe was inconclusive."""
    from orchestrator.client import ServiceError
    from orchestrator.cluster_auth import ClusterAuth, InsecureClusterError

    assert ClusterAuth("h:1", worker_mode="token", gcs_without_token="refused").token_auth
    assert not ClusterAuth("h:1", worker_mode="token", gcs_without_token="answered").token_auth
    assert not ClusterAuth("h:1", worker_mode="disabled", gcs_without_token="answered").token_auth
    assert ClusterAuth("h:1", worker_mode="token", gcs_without_token="unknown (UNAVAILABLE: tls)").token_auth
    assert not ClusterAuth("h:1", worker_mode="disabled", gcs_without_token="unknown (UNAVAILABLE: tls)").token_auth
    assert issubclass(InsecureClusterError, ServiceError)   # the CLI reports it as one line, exit code 2


@pytest.mark.long
def test_aspen_serve_refuses_a_cluster_without_token_auth(client_home, tiny_model_dirs, tmp_path):
    """A head started open (a fresh machine, no token generated first): `aspen serve` says so and how to
    turn token authentication on, whatever the client's own RAY_AUTH_MODE; with --insecure it serves, and
    connecting to the running service again is not refused."""
    open_head = start_head(token=False)
    try:
        serve = [str(BIN / "aspen"), "serve", "--address", open_head["gcs"], "--state-dir", str(tmp_path / "state"),
                 "--base-model", str(tiny_model_dirs["llama"]), "--step-tokens", "512"]
        token_mode_client = {**plain_env(client_home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
        for env in (plain_env(client_home), token_mode_client):
            refused = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=180)
            assert refused.returncode != 0, refused.stdout + refused.stderr[-3000:]
            assert "aspen service running" not in refused.stdout
            lines = [line for line in refused.stderr.splitlines() if line.startswith("aspen:")]
            assert len(lines) == 1, refused.stderr[-3000:]
            for words in ("without token authentication", "`ray get-auth-token --generate`", "`ray start --head`",
                          "RAY_AUTH_TOKEN", "RAY_AUTH_MODE=token", "--insecure"):
                assert words in lines[0], lines[0]

        env = plain_env(client_home)
        served = subprocess.run([*serve, "--insecure"], env=env, capture_output=True, text=True, timeout=600)
        assert served.returncode == 0, (served.stdout + served.stderr)[-4000:]
        assert "aspen service running" in served.stdout
        again = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=300)   # it runs: left alone
        assert again.returncode == 0 and "aspen service running" in again.stdout, (again.stdout + again.stderr)[-4000:]
        stopped = subprocess.run([str(BIN / "aspen"), "stop", "--address", open_head["gcs"]], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert stopped.returncode == 0, stopped.stderr[-3000:]
    finally:
        stop_head(open_head)


@pytest.mark.long
def test_ray_job_submit_runs_aspen_run_with_token_auth(head, tiny_model_dirs, tmp_path):
    work = write_working_dir(tmp_path / "work", tiny_model_dirs["llama"], tmp_path / "out")
    refused = ray_job_submit(head, work, "aspen", "run", "jobs.yaml", token=False)
    assert refused.returncode != 0 and "authentication token" in (refused.stdout + refused.stderr)
    result = ray_job_submit(head, work, "aspen", "run", "-q", "jobs.yaml")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "succeeded" in output and "completed" in output
    for name in ("alpha", "beta"):
        assert (tmp_path / "out" / name / "adapter_model.safetensors").is_file()
        rows = (tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1, 2, 3]


@pytest.mark.long
def test_ray_job_submit_to_a_running_aspen_serve(head, tiny_model_dirs, tmp_path):
    work = write_working_dir(tmp_path / "work", tiny_model_dirs["llama"], tmp_path / "out", steps=4)
    served = ray_job_submit(head, work, "aspen", "serve", "--state-dir", str(tmp_path / "state"),
                            "--base-model", str(tiny_model_dirs["llama"]), "--step-tokens", "512",
                            "--output-root", str(tmp_path / "out"))
    assert served.returncode == 0, (served.stdout + served.stderr)[-4000:]
    assert "aspen service running" in served.stdout + served.stderr
    assert f"jobs write under {tmp_path / 'out'}" in served.stdout + served.stderr
    submitted = ray_job_submit(head, work, "aspen", "submit", "jobs.yaml")
    assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-4000:]
    ids = re.findall(r"submitted (\S+-[0-9a-f]{6}) \((alpha|beta)\)", submitted.stdout + submitted.stderr)
    assert sorted(name for _, name in ids) == ["alpha", "beta"]

    def status() -> list[dict]:
        result = subprocess.run([str(BIN / "aspen"), "status", "--json", "--address", head["gcs"]],
                                env=with_token(head), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    deadline = time.time() + 300
    while True:
        jobs = status()
        if len(jobs) == 2 and all(j["state"] == "completed" for j in jobs):
            break
        assert time.time() < deadline, jobs
        assert not any(j["state"] == "failed" for j in jobs), jobs
        time.sleep(2)
    assert sorted(j["name"] for j in jobs) == ["alpha", "beta"] and all(j["step"] == 4 for j in jobs)
    stopped = subprocess.run([str(BIN / "aspen"), "stop", "--address", head["gcs"]], env=with_token(head),
                             capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 0, stopped.stderr[-3000:]


@pytest.mark.long
def test_the_http_servers_link_to_a_cluster_that_refuses_its_token_is_a_503_naming_the_fix(head):
    """`aspen http`'s Ray connection (orchestrator/service_calls.py) with another cluster's token: a 503 (the
    SDKs and the console retry it) whose detail says what refused it and what to set, not Ray's bare error."""
    script = ("import json\nfrom fastapi import HTTPException\n"
              "from orchestrator.service_calls import ServiceLink, call_service\n"
              f"link = ServiceLink({head['gcs']!r})\n"
              "try:\n    call_service(link, lambda client: client.jobs())\n"
              "except HTTPException as error:\n    print(json.dumps([error.status_code, error.detail]))\n")
    env = {**plain_env(head["client_home"]), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
    result = subprocess.run([str(BIN / "python"), "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]
    status, detail = json.loads(result.stdout.strip().splitlines()[-1])
    assert status == 503, detail
    assert detail.startswith("the aspen service cannot be reached: ") and "RAY_AUTH_TOKEN" in detail, detail
    assert "refused this process's token" in detail and "another cluster's" in detail, detail
    assert "--address" in detail, detail
