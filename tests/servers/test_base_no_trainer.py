"""A job for a base model no trainer of the service holds, submitted to a real service (its trainers hold the one base
their kind names, loaded as they start; none loads another on demand): it was entered and waited queued for ever.
Now refused up front, nothing entered, alike through the HTTP API (422), `aspen submit --url` (exit 2) and the Ray
client `aspen submit` uses: the message names the job's base, the bases the service's trainers hold (as its own
description of its trainers reports them) and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from actors.service.scheduler.submissions import SubmissionError
from orchestrator.jobs_file import load_run_spec
from tests.helpers.service import job_dict, write_task_data

REPO = Path(__file__).resolve().parents[2]


def test_a_base_no_trainer_holds_is_refused_saying_which_bases_they_hold(api, tiny_model_dirs, tmp_path):
    other = str(tiny_model_dirs["qwen2"])   # a base that exists, which no trainer of the service holds
    held = {trainer["base_model"] for trainer in api.ray.trainers()}
    assert held == {api.base}, held
    job = {**job_dict("elsewhere", write_task_data(tmp_path / "data", "t"), 2), "base_model": other}
    before = api.table()

    answer = httpx.post(f"{api.url}/v1/jobs", json=job, headers=api.auth(), timeout=120)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert f"no trainer of this service holds base model {other} with quantization none" in detail, detail
    assert f"they hold {api.base} (quantization none)" in detail and "load no other base on demand" in detail, detail
    assert f"trainers: - base_model: {other}" in detail and "restart the service" in detail, detail
    assert api.table() == before   # nothing entered

    jobs_file = tmp_path / "jobs.yaml"
    jobs_file.write_text(f"base_model: {other}\njobs:\n  - name: elsewhere\n    data: {job['data']}\n"
                         f"    format: {{type: prompt_response, prompt: \"Q: {{question}}\\nA:\", response: "
                         f"\" {{answer}}\"}}\n    max_steps: 2\n")
    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--url", api.url],
                         env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token},
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2, (cli.returncode, cli.stderr)
    assert f"no trainer of this service holds base model {other}" in cli.stderr, cli.stderr
    assert "Traceback" not in cli.stderr
    with pytest.raises(SubmissionError, match=f"they hold {api.base} \\(quantization none\\)"):
        api.ray.submit_many(load_run_spec(jobs_file, for_a_service=True).submissions())
    assert api.table() == before
