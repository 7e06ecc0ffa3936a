"""`ray job submit` against a real head node (`ray start --head`, Ray's token authentication on, as
Ray 2.60 sets it up by default): `aspen run` as the job's entry point, and `aspen serve` followed by
`aspen submit` to the running service."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.service_helpers import write_task_data

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def head():
    gcs, dashboard = free_port(), free_port()
    # the agents' ports too: their defaults (52365, ...) may be held by the test session's own Ray, and a
    # head whose job agent cannot bind answers every submission with "No available agent to submit job"
    agent_ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]
    temp_dir = tempfile.mkdtemp(prefix="aspen-ray-")  # short: Ray's socket paths must stay short
    process = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=2",
         "--object-store-memory=200000000", f"--temp-dir={temp_dir}", *agent_ports],
        env=plain_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:   # 401 without a token: the server is up
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError(f"ray start --head did not come up (exit code {process.poll()})") from None
                time.sleep(1)
        token = subprocess.run([str(BIN / "ray"), "get-auth-token"], env=plain_env(), capture_output=True,
                               text=True, timeout=60, check=True).stdout.strip().splitlines()[-1]
        yield {"dashboard": f"http://127.0.0.1:{dashboard}", "gcs": f"127.0.0.1:{gcs}", "token": token}
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        subprocess.run(["pkill", "-9", "-f", temp_dir], check=False)


def with_token(head: dict) -> dict[str, str]:
    return {**plain_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": head["token"]}


def write_working_dir(folder: Path, base: Path, output_dir: Path, steps: int = 3) -> Path:
    write_task_data(folder / "data", "alpha")
    write_task_data(folder / "data", "beta", offset=4)
    jobs = {"base_model": str(base), "output_dir": str(output_dir), "step_tokens": 512, "jobs": [
        {"name": name, "data": f"data/{name}.jsonl", "max_steps": steps, "batch_size": 4,
         "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
         "lora": {"r": 4, "alpha": 8}} for name in ("alpha", "beta")]}
    (folder / "jobs.yaml").write_text(json.dumps(jobs, indent=1))  # JSON is YAML
    return folder


def ray_job_submit(head: dict, working_dir: Path, *entrypoint: str, token: bool = True):
    """`ray job submit`, submitted again while the head's job agent is still starting (a loaded machine
    can take tens of seconds after the dashboard answers), as Ray's own message asks."""
    env = with_token(head) if token else plain_env()
    deadline = time.time() + 120
    while True:
        result = subprocess.run([str(BIN / "ray"), "job", "submit", "--address", head["dashboard"],
                                 "--working-dir", str(working_dir), "--", *entrypoint], env=env,
                                capture_output=True, text=True, timeout=600)
        if "No available agent to submit job" not in result.stderr + result.stdout or time.time() > deadline:
            return result
        time.sleep(3)


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


def test_ray_job_submit_to_a_running_aspen_serve(head, tiny_model_dirs, tmp_path):
    work = write_working_dir(tmp_path / "work", tiny_model_dirs["llama"], tmp_path / "out", steps=4)
    served = ray_job_submit(head, work, "aspen", "serve", "--state-dir", str(tmp_path / "state"),
                            "--base-model", str(tiny_model_dirs["llama"]), "--step-tokens", "512")
    assert served.returncode == 0, (served.stdout + served.stderr)[-4000:]
    assert "aspen service running" in served.stdout + served.stderr
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
