"""A sweep whose planted searcher fails while its first trial trains on, on a real service (the `api` fixture of
tests/servers), and the real `aspen` CLI against that service (tests/servers/test_http_sweep_cancel.py,
test_http_sweep_replaced.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from orchestrator.http.api_client import HttpClient
from tests.helpers.service import job_dict, wait_for, write_task_data

REPO = Path(__file__).resolve().parents[2]


def cli(api, *args: str) -> subprocess.CompletedProcess:
    """`aspen ARGS --url` the service, run to its end."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--url", api.url], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token},
                          capture_output=True, text=True, timeout=300)


def failed_sweep(api, tmp_path: Path, name: str, searcher: str, eval_every: int):
    """Sweep `name` (2 trials of 400 steps, one at a time, its searcher tests.helpers.searchers:`searcher`) submitted
    and seen failed by the planted searcher failure, its first trial's job still running: (the HTTP client, the
    sweep's dict, its output_dir, that trial's job)."""
    http = HttpClient(api.url, api.token)
    data = write_task_data(tmp_path / "data", "qa", rows=24)
    out = tmp_path / "out"
    sweep = {"name": name, "base_model": api.base, "output_dir": str(out), "step_tokens": 512,
             "job": {**job_dict("qa", data, 400, eval_split=4, eval_every=eval_every), "checkpoint_every": 4},
             "search": f"tests.helpers.searchers:{searcher}", "trials": 2, "max_concurrent": 1,
             "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    assert http.sweep(sweep)["state"] == "running"
    failed = wait_for(lambda: (found := http.sweep_status(name))["state"] == "failed" and found, 180,
                      f"sweep {name}'s searcher to fail")
    assert "planted searcher failure" in failed["error"]
    (trial,) = [j for j in http.jobs() if j.name == "qa-t0" and str(out) in j.output_dir]
    assert trial.state == "running"   # a failed sweep follows its trial no longer: it trains on
    return http, sweep, out, trial
