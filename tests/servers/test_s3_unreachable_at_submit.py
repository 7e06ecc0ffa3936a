"""Jobs whose data is on S3, submitted while the store cannot be reached at all (an endpoint on a port nothing listens
on: connection refused), through the real HTTP server and its client, the real `aspen submit --url` and `aspen submit
--address` (over Ray) and the Ray client: the HTTP API's row check let the storage error out as a 500 ("Internal
Server Error", the cause only in the server's log). Now it answers 502 naming the job, the URI, the endpoint it asked
and what to check, nothing entered; over Ray the same words, exit 1 both ways (the request is fine: the same command
passes once the store answers, as it does here against a real moto S3 server, the reference for the jobs being
fine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.scheduler.config import SCHEDULER_NAME
from actors.storage.storage_errors import StorageUnreachable
from orchestrator.client import Client
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import HttpApiError, HttpClient
from orchestrator.http.token import ensure_token
from tests.helpers.http_server import running_server, write_jobs_file
from tests.helpers.ports import free_port
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, write_task_data

REPO = Path(__file__).resolve().parents[2]


def aspen_submit(jobs_file: Path, *where: str, token: str = "") -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (this process's S3 environment inherited: the dead endpoint)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), *where],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": token})


def cause_left_out(message: str) -> str:
    """The message without the store library's own words at its end (curl's 'after N ms' varies)."""
    return message.split(" (OSError: ")[0]


@pytest.mark.long   # a service of its own, an HTTP server, two CLI processes: ~40 s
def test_a_store_that_cannot_be_reached_is_said_at_submit_over_http_and_over_ray(
        ray_session, s3_server, s3_bucket, tiny_model_dirs, tmp_path, monkeypatch):
    import boto3

    boto3.client("s3", endpoint_url=s3_server.endpoint).put_object(
        Bucket=s3_bucket, Key="sets/good.jsonl", Body=write_task_data(tmp_path / "data", "good").read_bytes())
    uri, base = f"s3://{s3_bucket}/sets/good.jsonl", str(tiny_model_dirs["llama"])
    jobs_file = tmp_path / "jobs.yaml"
    write_jobs_file(jobs_file, base, [job_dict("remote", uri, 2)])
    sweep = {"name": "remote-sweep", "base_model": base, "output_dir": str(tmp_path / "sweep"), "step_tokens": 512,
             "search": "grid", "max_concurrent": 1, "objective": "train_loss",
             "space": {"lr": {"choice": [0.001, 0.002]}}, "job": job_dict("trial", uri, 2)}
    dead = f"http://127.0.0.1:{free_port()}"   # nothing listens there

    service = Client.local(service_config(tmp_path / "state", tiny_model_dirs["llama"], num_gpus=1,
                                          listeners=NO_LISTENERS), name=SCHEDULER_NAME, wait_ready=False)
    token = ensure_token(tmp_path / "http-token")
    address = ray_session.get_runtime_context().gcs_address
    try:
        with running_server(create_app(ServiceLink(client=service), token)) as url:
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)   # the server's and the CLI's store: gone
            with pytest.raises(HttpApiError) as over_http:
                HttpClient(url, token).submit_run(jobs_file)
            with pytest.raises(HttpApiError) as sweep_over_http:
                HttpClient(url, token).sweep(sweep)
            by_url = aspen_submit(jobs_file, "--url", url, token=token)
            by_address = aspen_submit(jobs_file, "--address", address)
            with pytest.raises(StorageUnreachable) as by_client:
                service.submit_run(jobs_file)
            entered, sweeps = service.jobs(), service.sweeps()
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint)   # the store answers again
            (taken,) = HttpClient(url, token).submit_run(jobs_file)
    finally:
        service.shutdown()
    assert entered == [] and sweeps == []   # nothing was entered while the store did not answer
    assert taken.name == "remote"           # the same jobs file, once the store answers

    for refused in (over_http.value, sweep_over_http.value):
        assert refused.status == 502, (refused.status, str(refused))
    detail = str(over_http.value)
    assert detail.startswith(f"job 'remote': the dataset {uri}: looking it up failed: the storage endpoint cannot "
                             f"be reached at {dead} (AWS_ENDPOINT_URL_S3): check that the store is up"), detail
    assert "Traceback" not in detail and "Internal Server Error" not in detail, detail
    assert str(sweep_over_http.value).startswith(f"job 'trial': the dataset {uri}: "), sweep_over_http.value
    # over Ray and through the CLI both ways: the same words, exit 1 (not the request's fault: not 2)
    for result in (by_url, by_address):
        assert result.returncode == 1 and "Traceback" not in result.stderr, (result.returncode, result.stderr)
        assert cause_left_out(result.stderr).strip() == f"aspen: {cause_left_out(detail)}", result.stderr
    assert cause_left_out(str(by_client.value)) == cause_left_out(detail), by_client.value
