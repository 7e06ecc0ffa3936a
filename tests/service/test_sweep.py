"""`aspen sweep`'s driver (orchestrator/sweep.py) on a real service: a grid with one planted good learning rate
and one that cannot learn, with successive halving. The first trial (good) trains to the end and the best is a
good one; the hopeless ones are stopped at the first rung against it and their jobs cancelled; the best
trial's adapter equals the same job trained alone; the sweep file run again finds every trial done and submits
nothing. One trial at a time (max_concurrent: 1): which trial a rung judges first is then the trial order,
not the order two job actors' evaluations happened to arrive in (trials fused together: tests/unit/service/
test_sweep_run.py and the fused-job tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from actors.engine.models import load_base_model
from actors.service.config import run_service_config
from actors.service.local_run import train_locally
from orchestrator.client import Client
from orchestrator.sweep import SweepDriver, load_sweep_spec, service_run_spec
from tests.helpers.service import adapter_tensors, job_dict, max_relative_difference, run_spec, write_task_data

GOOD_LR, HOPELESS_LR = 5e-3, 1e-9
STEPS = 24


def test_a_sweep_keeps_the_good_trials_stops_the_hopeless_and_resumes_done(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "qa", rows=48)
    # 24 steps of the tiny model take seconds: a hopeless trial judged at step 4 (the driver looks every 0.2 s)
    # is cancelled long before its end
    job = {**job_dict("qa", data, STEPS, eval_split=8, eval_every=4), "checkpoint_every": 1000}
    sweep = {"name": "lr", "base_model": base, "output_dir": str(tmp_path / "out"), "step_tokens": 1024,
             "job": job, "search": "grid", "max_concurrent": 1, "objective": "eval_loss",
             # the good rate first: the hopeless ones then meet its results at the first rung
             "space": {"lr": {"choice": [GOOD_LR, HOPELESS_LR]}, "lora.r": {"choice": [4, 8]}},
             "stopping": {"asha": {"grace_steps": 4, "reduction": 2}}}
    (tmp_path / "sweep.yaml").write_text(json.dumps(sweep))   # JSON is YAML
    spec = load_sweep_spec(tmp_path / "sweep.yaml")
    client = Client.local(run_service_config(service_run_spec(spec), state_dir=tmp_path / "state"))
    try:
        board = SweepDriver(client, spec, tmp_path / "out").follow(poll_s=0.2)
        trials = {t["name"]: t for t in board["trials"]}
        good = [t for t in trials.values() if t["settings"]["lr"] == GOOD_LR]
        hopeless = [t for t in trials.values() if t["settings"]["lr"] == HOPELESS_LR]
        assert trials["qa-t0"]["state"] == "completed" and trials["qa-t0"]["steps"] == STEPS
        assert all(t["state"] in ("completed", "stopped") for t in good), good   # the second judged against it
        assert board["best"] in {t["name"] for t in good if t["state"] == "completed"}
        assert all(t["state"] == "stopped" and t["steps"] == 4 and "outside the best 1/2" in t["stopped_because"]
                   for t in hopeless), hopeless
        jobs = {record.name: record for record in client.jobs()}
        assert all(jobs[t["name"]].state == "cancelled" and jobs[t["name"]].step < STEPS for t in hopeless)
        assert json.loads((tmp_path / "out" / "leaderboard.json").read_text()) == board
        submitted = len(client.jobs())
        again = SweepDriver(client, load_sweep_spec(tmp_path / "sweep.yaml"), tmp_path / "out")
        assert again.poll() and len(client.jobs()) == submitted and again.run.leaderboard() == board
    finally:
        client.shutdown()
    best = next(job for job in spec.trial_jobs() if job.name == board["best"])
    alone = run_spec(base, tmp_path / "alone", [best.model_dump(mode="json", exclude_unset=True)], step_tokens=1024)
    train_locally(alone, base=load_base_model(base, dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out" / best.name),
                                         adapter_tensors(tmp_path / "alone" / best.name))
    assert difference <= 1e-4, difference


@pytest.mark.parametrize(("extra", "message"), [
    ("space: {lora.rank: {choice: [8, 16]}}\n", "sweep.yaml: space.lora.rank: job.lora has no field 'rank'; did you "
                                                 "mean lora.r?"),
    ("space: {lora.r: {choice: [8, 16]}}\nsearch: optuna\nsearch_options: {n_startup: 3}\n",
     "sweep.yaml: search_options: optuna (ray.tune.search.optuna.optuna_search.OptunaSearch) refused them"),
])
def test_a_bad_sweep_file_is_refused_before_anything_starts(tmp_path, extra, message):
    (tmp_path / "qa.jsonl").write_text("")
    (tmp_path / "sweep.yaml").write_text(
        "name: s\noutput_dir: out\njob: {name: qa, data: qa.jsonl, format: {type: alpaca}, max_steps: 40, "
        "eval_split: 8, eval_every: 4}\ntrials: 2\n" + extra)
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", "sweep.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"})
    assert result.returncode == 2, result
    assert "aspen: invalid sweep file:" in result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
