"""Cancelling a failed sweep, and a replacement's status, over a real service's HTTP API and the real `aspen` CLI
(docs/sweeps.md, "Cancelling"). Before, a sweep whose searcher raised was held failed and `aspen sweep cancel` left it
failed (its answer still "failed", its trial's job cancelled but never followed again: the replacement's refusal had to
send its user to `aspen cancel JOB` first); the sweep it was replaced by said where the old results went only in the
answer to its submission. Now the cancel ends the failed sweep `cancelled` (the searcher, still raising as the cancelled
trial's end is told to it, is logged, not raised), its job cancelled, its state file cancelled; and `aspen sweep
status NAME` of the sweep that replaces it says which sweep it replaced and the folder its results moved to, as the
service's sweep status (persisted with the sweep's state) does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.http.api_client import HttpClient
from tests.helpers.service import job_dict, wait_for, write_task_data

REPO = Path(__file__).resolve().parents[2]


def cli(api, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args, "--url", api.url], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.long
def test_a_failed_sweep_is_cancelled_and_its_replacement_says_what_it_replaced(api, tmp_path):
    http = HttpClient(api.url, api.token)
    data = write_task_data(tmp_path / "data", "qa", rows=24)
    out = tmp_path / "out"
    old = {"name": "broke", "base_model": api.base, "output_dir": str(out), "step_tokens": 512,
           "job": {**job_dict("qa", data, 400, eval_split=4, eval_every=2), "checkpoint_every": 4},
           "search": "tests.helpers.searchers:FailsAtEveryWord", "trials": 2, "max_concurrent": 1,
           "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    assert http.sweep(old)["state"] == "running"
    failed = wait_for(lambda: (found := http.sweep_status("broke"))["state"] == "failed" and found, 180,
                      "the sweep's searcher to fail")
    assert "planted searcher failure" in failed["error"]
    (trial,) = [j for j in http.jobs() if j.name == "qa-t0" and str(out) in j.output_dir]
    assert trial.state == "running"

    cancelled = cli(api, "sweep", "cancel", "broke")
    assert cancelled.returncode == 0, cancelled.stderr
    assert "aspen: sweep broke had failed (RuntimeError: planted searcher failure" in cancelled.stderr
    ended = wait_for(lambda: (found := http.sweep_status("broke"))["state"] == "cancelled" and found, 120,
                     "the failed sweep to end cancelled")
    assert ended["error"] is None and [t["state"] for t in ended["trials"]] == ["cancelled"]
    # the searcher, raising as it hears the cancelled trial's end, is in the sweep's status (not only the log)
    assert ended["searcher_errors"]["count"] >= 1
    assert any("planted searcher failure at qa-t0's end" in e for e in ended["searcher_errors"]["last"])
    shown = cli(api, "sweep", "status", "broke")
    assert shown.returncode == 0, shown.stderr
    assert "its searcher raised" in shown.stdout and "planted searcher failure at qa-t0's end" in shown.stdout
    assert http.status(trial.id).state == "cancelled"
    stored = json.loads((Path(api.state_dir) / "sweeps" / "broke.json").read_text())
    assert stored["driver"]["cancelled"] and "failed" not in stored

    # replaced by one of other settings: its status (later, over HTTP and the CLI) says where the old results went
    new = {**old, "search": "grid", "trials": None, "job": {**old["job"], "max_steps": 2},
           "space": {"lr": {"choice": [3e-3]}}}
    added = http.sweep(new)
    assert added["replaced"]["folder"] == str(out / "replaced-1") and added["replaced"]["state"] == "cancelled"
    assert http.sweep_status("broke")["replaced"] == added["replaced"]
    shown = cli(api, "sweep", "status", "broke")
    assert shown.returncode == 0, shown.stderr
    assert f"it replaced sweep broke (cancelled), whose results are in {out / 'replaced-1'}" in shown.stdout
    assert json.loads((out / "replaced-1" / "leaderboard.json").read_text())["replaced"]["jobs"] == {"qa-t0": trial.id}
    done = wait_for(lambda: (found := http.sweep_status("broke"))["state"] == "done" and found, 180, "the new sweep")
    assert done["replaced"] == added["replaced"]
