"""Jobs whose data is on S3 (a real moto server), submitted over Ray: the real `aspen submit --address` and the
Python client (`Client.submit_run`, `submit_many`, `sweep`) read no s3:// rows before they submitted (only a local
file's), so a dataset the store has not, or one with a row that is not JSON, was entered and failed on its trainer
later; the HTTP API (the reference here: a real server over the same service) refused both up front. Now the Ray
path reads them as the HTTP API does: the same message for each job, at the jobs file's line of its `data`, exit
2, nothing entered. The store itself says what is there (boto3, not aspen's code)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.scheduler.config import SCHEDULER_NAME
from orchestrator.client import Client
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import HttpClient, SpecRefused
from orchestrator.http.token import ensure_token
from orchestrator.jobs_file import SpecError
from tests.helpers.http_server import running_server, write_jobs_file
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, write_task_data

REPO = Path(__file__).resolve().parents[2]


def aspen_submit(jobs_file: Path, address: str) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, over Ray (the S3 server's environment inherited)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--address", address],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)


@pytest.mark.long   # a service of its own, a CLI process, an HTTP server: ~40 s
def test_s3_data_is_read_at_submit_over_ray_as_over_http(ray_session, s3_bucket, tiny_model_dirs, tmp_path):
    import boto3

    store = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    rows = write_task_data(tmp_path / "data", "broken").read_text().splitlines()
    rows[2] = '{"question": "a question", "answer": '   # line 3: not JSON
    store.put_object(Bucket=s3_bucket, Key="sets/broken.jsonl", Body="\n".join(rows).encode() + b"\n")
    store.put_object(Bucket=s3_bucket, Key="sets/good.jsonl",
                     Body=write_task_data(tmp_path / "data", "good").read_bytes())
    missing, broken = f"s3://{s3_bucket}/sets/nothere.jsonl", f"s3://{s3_bucket}/sets/broken.jsonl"
    # the reference for what is there: the store's own listing
    listed = {item["Key"] for item in store.list_objects_v2(Bucket=s3_bucket, Prefix="sets/")["Contents"]}
    assert listed == {"sets/broken.jsonl", "sets/good.jsonl"}
    base = str(tiny_model_dirs["llama"])
    jobs = [job_dict("fine", f"s3://{s3_bucket}/sets/good.jsonl", 2), job_dict("absent", missing, 2),
            job_dict("broken", broken, 2)]
    jobs_file = tmp_path / "jobs.yaml"
    text = write_jobs_file(jobs_file, base, jobs)
    sweep = {"name": "remote", "base_model": base, "output_dir": str(tmp_path / "sweep"), "step_tokens": 512,
             "search": "grid", "max_concurrent": 1, "objective": "train_loss",
             "space": {"lr": {"choice": [0.001, 0.002]}},
             "job": job_dict("remote", missing, 2)}
    data_lines = [number for number, line in enumerate(text.splitlines(), 1) if line.startswith("    data:")]

    # its trainer wants a GPU this machine has not: it never loads the base (the rows are read with its tokenizer)
    service = Client.local(service_config(tmp_path / "state", tiny_model_dirs["llama"], num_gpus=1,
                                          listeners=NO_LISTENERS), name=SCHEDULER_NAME, wait_ready=False)
    token = ensure_token(tmp_path / "http-token")
    try:
        with running_server(create_app(ServiceLink(client=service), token)) as url:
            with pytest.raises(SpecRefused) as over_http:
                HttpClient(url, token).submit_run(jobs_file)
            with pytest.raises(SpecRefused) as sweep_over_http:
                HttpClient(url, token).sweep(sweep)
        over_ray = aspen_submit(jobs_file, ray_session.get_runtime_context().gcs_address)
        with pytest.raises(SpecError) as by_client:
            service.submit_run(jobs_file)
        with pytest.raises(SpecError) as by_many:   # job dicts, no file: the same messages, no line
            service.submit_many(jobs, base_model=base)
        with pytest.raises(SpecError) as sweep_by_client:
            service.sweep(sweep)
        entered, sweeps = service.jobs(), service.sweeps()
    finally:
        service.shutdown()
    assert entered == [] and sweeps == []   # all or none: not even the fine job

    errors = {error["job"]: error for error in over_http.value.errors}
    assert set(errors) == {"absent", "broken"}, errors
    assert errors["absent"]["type"] == "data_unreadable" and errors["absent"]["loc"] == ["jobs", 1, "data"]
    assert errors["absent"]["msg"] == f"{missing}: not found; check the dataset URI", errors["absent"]
    assert errors["broken"]["row"] == 3 and errors["broken"]["msg"].startswith(f"{broken}:3: invalid JSON")

    said = over_ray.stderr
    assert over_ray.returncode == 2 and "Traceback" not in said, (over_ray.returncode, said)
    absent_line = f"{jobs_file}:{data_lines[1]}: job 'absent', field data: {errors['absent']['msg']}"
    broken_line = f"job 'broken': {errors['broken']['msg']}"
    for refused in (said, str(by_client.value)):
        assert absent_line in refused and broken_line in refused, refused
        assert "fix the URI of the job's data and the rows or the format" in refused, refused
    assert f"job 'absent', field data: {errors['absent']['msg']}" in str(by_many.value), by_many.value
    assert broken_line in str(by_many.value), by_many.value
    (sweep_error,) = sweep_over_http.value.errors
    assert sweep_error["loc"] == ["job", "data"] and sweep_error["msg"] == errors["absent"]["msg"], sweep_error
    assert f"job 'remote': {sweep_error['msg']}" in str(sweep_by_client.value), sweep_by_client.value
