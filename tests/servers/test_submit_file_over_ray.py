"""A one-job jobs file submitted by the Python client, `Client.submit(path)`, against the real `aspen submit --address`
(the CLI a user runs, over Ray) and docs/spec.md ("relative paths are relative to the file"): `Client.submit(path)`
loaded the file and passed its spec on, so a relative output_dir was taken from the process's current folder (not the
file's, as `aspen submit` and `Client.submit_run(path)` take it), and a dataset that cannot be read at all was named
without the jobs file's line of its `data` (which `aspen submit` and `submit_run(path)` give). Now both as the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.scheduler.config import SCHEDULER_NAME
from orchestrator.client import Client
from orchestrator.jobs_file import SpecError
from tests.helpers.http_server import write_jobs_file
from tests.helpers.service import NO_LISTENERS, job_dict, service_config, write_task_data

REPO = Path(__file__).resolve().parents[2]


def aspen_submit(jobs_file: Path, address: str, cwd: Path) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess, over Ray, from `cwd` (the S3 server's environment inherited)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--address", address],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
                          cwd=cwd)


def jobs_file(path: Path, base: str, job: dict) -> tuple[Path, int]:
    """A one-job file whose output_dir is relative (`runs`, under the file's folder); and its `data` line."""
    text = write_jobs_file(path, base, [job])
    path.write_text(text.replace("jobs:\n", "output_dir: runs\njobs:\n"))
    lines = path.read_text().splitlines()
    return path, next(number for number, line in enumerate(lines, 1) if line.startswith("    data:"))


@pytest.mark.long   # a service of its own, two CLI processes: ~30 s
def test_a_one_job_file_is_taken_from_its_folder_and_refused_at_its_line_as_aspen_submit_takes_it(
        ray_session, s3_bucket, tiny_model_dirs, tmp_path, monkeypatch):
    base = str(tiny_model_dirs["llama"])
    folder, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    write_task_data(folder / "data", "qa")
    elsewhere.mkdir()
    # data relative to the file, as a user writes it; output_dir `runs`: the file's folder's, per docs/spec.md
    solo, _ = jobs_file(folder / "solo.yaml", base, job_dict("solo", Path("data/qa.jsonl"), 2))
    by_cli, _ = jobs_file(folder / "by-cli.yaml", base, job_dict("by-cli", Path("data/qa.jsonl"), 2))
    missing = f"s3://{s3_bucket}/sets/nothere.jsonl"
    absent, data_line = jobs_file(folder / "absent.yaml", base, job_dict("absent", missing, 2))
    monkeypatch.chdir(elsewhere)   # the user's shell is elsewhere: relative paths are still the file's

    # its trainer wants a GPU this machine has not: its jobs stay queued (their records say where they write)
    service = Client.local(service_config(tmp_path / "state", tiny_model_dirs["llama"], num_gpus=1,
                                          listeners=NO_LISTENERS), name=SCHEDULER_NAME, wait_ready=False)
    address = ray_session.get_runtime_context().gcs_address
    try:
        submitted = aspen_submit(by_cli, address, elsewhere)
        refused = aspen_submit(absent, address, elsewhere)
        handle = service.submit(solo)
        with pytest.raises(SpecError) as by_submit:
            service.submit(absent)
        with pytest.raises(SpecError) as by_submit_run:
            service.submit_run(absent)
        records = {record.name: record for record in service.jobs()}
    finally:
        service.shutdown()

    assert submitted.returncode == 0, submitted.stderr
    assert set(records) == {"solo", "by-cli"}, records   # nothing of the refused file entered
    # the CLI's folder for its job, and the documented one: under the jobs file's folder, not the current one
    assert records["by-cli"].output_dir == str(folder / "runs" / "by-cli"), records["by-cli"]
    assert handle.name == "solo" and records["solo"].output_dir == str(folder / "runs" / "solo"), records["solo"]

    said = refused.stderr
    assert refused.returncode == 2 and "Traceback" not in said, (refused.returncode, said)
    at_line = f"{absent}:{data_line}: job 'absent', field data: {missing}: not found; check the dataset URI"
    assert at_line in said, said
    for error in (by_submit.value, by_submit_run.value):
        assert at_line in str(error), error
        assert "fix the URI of the job's data" in str(error), error
