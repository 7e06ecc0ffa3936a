"""Sweeps run by a real service's scheduler (actors/service/sweeps/sweep_book.py), submitted with `aspen sweep FILE
--address` (the CLI, in a process of its own, following it to the end and printing the leaderboard): a grid
with one planted good learning rate and one that cannot learn, with successive halving. The first trial (good)
trains to the end and the best is a good one; the hopeless ones are stopped at the first rung against it and
their jobs cancelled; the best trial's adapter equals the same job trained alone. The trainer's process is
killed while the first trial trains (it is replaced and the trial resumes from its checkpoint), then the
scheduler's mid-sweep: it restarts, reads the sweep's state and carries on, losing no trial. The leaderboard and
report.png are in the sweep's folder; the same sweep submitted again finds every trial done and starts
nothing. One trial at a time (max_concurrent: 1): which trial a rung judges first is then
the trial order, not the order two job actors' evaluations happened to arrive in (trials fused together:
tests/unit/service/test_sweep_run.py and the fused-job tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from actors.engine.models import load_base_model
from actors.service.scheduler.config import SCHEDULER_NAME, run_service_config
from actors.service.scheduler.local_run import train_locally
from orchestrator.client import Client
from orchestrator.sweep import load_sweep_spec, service_run_spec
from tests.helpers.service import (
    adapter_tensors,
    job_dict,
    max_relative_difference,
    run_spec,
    wait_for,
    write_task_data,
)

GOOD_LR, HOPELESS_LR = 5e-3, 1e-9
STEPS = 400
RUNG = 20   # the first rung (grace_steps), where each trial first reports its eval loss


@pytest.mark.long
def test_a_sweep_keeps_the_good_trials_stops_the_hopeless_and_survives_its_scheduler(ray_session, tiny_model_dirs,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setenv("ASPEN_RECENT_RUNS", str(tmp_path / "runs.json"))   # the runs this test's commands started
    base = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "data", "qa", rows=48)
    # a hopeless trial is judged once the scheduler sees its first eval, at step RUNG (a tick after the trainer's
    # poll answers: up to seconds on a loaded 2-core machine); one that ended first is not stopped (nothing is left
    # to save). A step of the tiny model takes 6-13 ms here (24 steps once ended first, tests/servers/
    # test_console.py): 380 steps left at a >=5 ms floor are >=1.9 s
    job = {**job_dict("qa", data, STEPS, eval_split=8, eval_every=RUNG), "checkpoint_every": RUNG}
    sweep = {"name": "lr", "base_model": base, "output_dir": str(tmp_path / "out"), "step_tokens": 1024,
             "job": job, "search": "grid", "max_concurrent": 1, "objective": "eval_loss",
             # the good rate first: the hopeless ones then meet its results at the first rung
             "space": {"lr": {"choice": [GOOD_LR, HOPELESS_LR]}, "lora.r": {"choice": [4, 8]}},
             "stopping": {"asha": {"grace_steps": RUNG, "reduction": 2}}}
    (tmp_path / "sweep.yaml").write_text(json.dumps(sweep))   # JSON is YAML
    spec = load_sweep_spec(tmp_path / "sweep.yaml")
    config = run_service_config(service_run_spec(spec), state_dir=tmp_path / "state")
    client = Client.local(config, name=SCHEDULER_NAME)   # the name `aspen sweep --address` looks for
    try:
        cli = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "sweep", "sweep.yaml", "--json", "--poll",
                                "0.2", "--address", ray.get_runtime_context().gcs_address], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def first_trial() -> dict:
            trials = client.sweep_status("lr")["trials"] if client.sweeps() else []
            return next((t for t in trials if t["name"] == "qa-t0"), {"steps": 0, "state": "pending"})

        wait_for(lambda: first_trial()["steps"] >= RUNG, 300, "the first trial's first eval")
        assert client.sweep_status("lr")["trials_planned"] == 4
        trainer = client.trainers()[0]   # its process dies while the first trial trains: replaced, the trial resumes
        ray.kill(ray.get_actor(trainer["actor_name"]))
        wait_for(lambda: first_trial()["steps"] >= 2 * RUNG or first_trial()["state"] != "running", 300,
                 "the first trial to go on after its trainer's end")
        assert client.sweep_status("lr")["state"] == "running"
        ray.kill(client.scheduler, no_restart=False)   # then the scheduler's: it comes back and carries the sweep on
        out, err = cli.communicate(timeout=600)
        assert cli.returncode == 0, (out, err)
        status = client.sweep_status("lr")
        assert status["state"] == "done" and status["error"] is None, status
        assert json.loads(out[out.rindex("\n{\n") + 1:]) == {"trials": status["trials"], "best": status["best"]}
        trials = {t["name"]: t for t in status["trials"]}
        assert sorted(trials) == ["qa-t0", "qa-t1", "qa-t2", "qa-t3"]               # none lost, none twice
        good = [t for t in trials.values() if t["settings"]["lr"] == GOOD_LR]
        hopeless = [t for t in trials.values() if t["settings"]["lr"] == HOPELESS_LR]
        assert trials["qa-t0"]["state"] == "completed" and trials["qa-t0"]["steps"] == STEPS
        assert all(t["state"] in ("completed", "stopped") for t in good), good   # the second judged against it
        assert status["best"] in {t["name"] for t in good if t["state"] == "completed"}
        assert all(t["state"] == "stopped" and t["steps"] == RUNG and " is higher than " in t["stopped_because"]
                   and "the best half" in t["stopped_because"] for t in hopeless), hopeless
        jobs = {record.name: record for record in client.jobs()}
        assert len(jobs) == 4
        assert all(jobs[t["name"]].state == "cancelled" and jobs[t["name"]].step < STEPS for t in hopeless)
        board = {"name": "lr", "trials": status["trials"], "best": status["best"]}
        assert json.loads((tmp_path / "out" / "leaderboard.json").read_text()) == board
        assert (tmp_path / "out" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert client.sweeps() == [client.sweep_status("lr")]
        shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", "status", str(tmp_path / "out"),
                                "--json"], capture_output=True, text=True,
                               env={**os.environ, "RAY_ADDRESS": "127.0.0.1:9"})   # from the folder: no service
        assert shown.returncode == 0 and json.loads(shown.stdout)["trials"] == status["trials"], shown
        assert json.loads(shown.stdout)["name"] == "lr"   # the sweep's name, not its folder's ("out")
        # the same sweep again (as `aspen sweep FILE` run again submits it) is the one that ran: nothing starts
        assert client.sweep(tmp_path / "sweep.yaml")["state"] == "done" and len(client.jobs()) == 4
        with pytest.raises(ValueError, match=r"sweep 'lr' exists with other settings \(done\); give the sweep "
                                             "another name"):
            client.sweep({**sweep, "max_concurrent": 2})
        with pytest.raises(KeyError, match="no sweep named 'nope'"):
            client.sweep_status("nope")
    finally:
        client.shutdown()
    # by its name, as a user types it once the service has ended (no cluster named, none running: other tests' run
    # beside this one, so Ray's search for one is made to find none, tests/helpers/cli_cluster_search.py): the folder
    # `aspen sweep` remembered
    unnamed = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    search = Path(__file__).resolve().parents[1] / "helpers" / "cli_cluster_search.py"
    named = subprocess.run([sys.executable, str(search), "sweep", "status", "lr", "--json"],
                           capture_output=True, text=True, cwd=tmp_path / "data", env=unnamed)
    assert named.returncode == 0 and json.loads(named.stdout)["trials"] == status["trials"], named
    # the cluster found here is another's, which refuses this process (this test's own, asked with another token):
    # still the folder, not Ray's connection error
    refused = subprocess.run([sys.executable, str(search), "sweep", "status", "lr", "--json"],
                             capture_output=True, text=True, cwd=tmp_path / "data",
                             env={**unnamed, "FOUND_CLUSTER": ray.get_runtime_context().gcs_address,
                                  "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
    assert refused.returncode == 0 and json.loads(refused.stdout)["trials"] == status["trials"], refused
    assert "no aspen service is running (Failed to connect" in refused.stderr, refused.stderr
    assert "no aspen service is running" in named.stderr and str(tmp_path / "out") in named.stderr
    best = next(job for job in spec.trial_jobs() if job.name == status["best"])
    alone = run_spec(base, tmp_path / "alone", [best.model_dump(mode="json", exclude_unset=True)], step_tokens=1024)
    train_locally(alone, base=load_base_model(base, dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out" / best.name),
                                         adapter_tensors(tmp_path / "alone" / best.name))
    assert difference <= 1e-4, difference


@pytest.mark.parametrize(("extra", "message"), [
    ("space: {lora.rank: {choice: [8, 16]}}\n", "sweep.yaml:5: space.lora.rank: job.lora has no field 'rank'; did you "
                                                 "mean lora.r?"),
    ("space: {lora.r: {choice: [8, 16]}}\nsearch: optuna\nsearch_options: {n_startup: 3}\n",
     "sweep.yaml:7: search_options: optuna (ray.tune.search.optuna.optuna_search.OptunaSearch) refused them"),
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
