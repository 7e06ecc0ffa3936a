"""Ctrl-C (SIGINT to the process group, as a terminal sends it) to `aspen sweep FILE` and `aspen demo`, each
running a service of its own, as `aspen run` is checked in tests/faults/test_run_again.py: the command says what
it left and what continues it, exit 130; its job table (read afterwards by `aspen status --from`, no service
running) shows the unfinished jobs paused, not queued for a service that is gone, their reason saying what
continues them; and the same `aspen sweep FILE` then carries the sweep on: the interrupted trial resumes from its
checkpoint and the sweep ends done."""

from __future__ import annotations

import json

import pytest

from tests.helpers.interrupted_runs import checkpoint_step, ctrl_c_once, finish, start_aspen, table_from
from tests.helpers.service import job_dict, write_task_data

STEPS = 400     # the trials' steps: room for the Ctrl-C after the first checkpoint (step 10) and before the end


@pytest.mark.long
def test_ctrl_c_to_aspen_sweep_leaves_its_trials_paused_and_the_same_command_carries_it_on(tmp_path,
                                                                                             tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "qa", rows=48)
    job = {**job_dict("qa", data, STEPS), "checkpoint_every": 10}
    sweep = {"name": "held", "base_model": str(tiny_model_dirs["llama"]), "output_dir": str(tmp_path / "out"),
             "step_tokens": 512, "job": job, "search": "grid", "max_concurrent": 1, "objective": "train_loss",
             "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    (tmp_path / "sweep.yaml").write_text(json.dumps(sweep))   # JSON is YAML
    first = tmp_path / "out" / "qa-t0"
    code, out, err = ctrl_c_once(start_aspen(tmp_path, "sweep", "sweep.yaml", "--poll", "0.2"),
                                 lambda: checkpoint_step(first) >= 10, "the jobs to train")
    assert code == 130, (code, out, err)
    assert "Traceback" not in err, err
    stopped_at = checkpoint_step(first)
    assert 10 <= stopped_at < STEPS
    jobs = table_from(tmp_path, tmp_path / "out")
    assert jobs["qa-t0"]["state"] == "paused", jobs
    assert jobs["qa-t0"]["reason"].startswith("held: its run stopped before it ended (Ctrl-C, SIGTERM); "
                                              "`aspen sweep sweep.yaml` continues it from its newest checkpoint"), jobs
    assert not [j for j in jobs.values() if j["state"] == "queued"], jobs
    said = err.splitlines()[-1]
    assert said.startswith("aspen: interrupted; the running jobs were checkpointed, and `aspen sweep sweep.yaml` "
                           "carries the sweep on from them"), err
    assert f"held paused until then: aspen status --from {tmp_path / 'out'}" in said, err

    code, out, err = finish(start_aspen(tmp_path, "sweep", "sweep.yaml", "--poll", "0.2", "--json"), timeout=600)
    assert code == 0, (code, out, err)
    board = json.loads(out[out.rindex("\n{\n") + 1:])
    trials = {t["name"]: t for t in board["trials"]}
    assert {name: (t["state"], t["steps"]) for name, t in trials.items()} == {
        "qa-t0": ("completed", STEPS), "qa-t1": ("completed", STEPS)}, board
    steps = [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == STEPS and steps.count(stopped_at + 1) == 1, steps[stopped_at - 2:stopped_at + 3]  # resumed
    jobs = table_from(tmp_path, tmp_path / "out")
    assert {name: job["state"] for name, job in jobs.items()} == {"qa-t0": "completed", "qa-t1": "completed"}, jobs


@pytest.mark.long
def test_ctrl_c_to_aspen_demo_leaves_its_jobs_paused_saying_what_to_do(tmp_path):
    from orchestrator.demo import TASKS

    def trained() -> bool:   # every job past its first step: all four running on the demo's service
        return all((tmp_path / "demo" / task.name / "metrics.jsonl").is_file() for task in TASKS)

    demo = start_aspen(tmp_path, "demo", "--quiet", "--steps", "400", "--output-dir", "demo")
    code, out, err = ctrl_c_once(demo, trained, "the jobs to train")
    assert code == 130, (code, out, err)
    assert "Traceback" not in err, err
    jobs = table_from(tmp_path, tmp_path / "demo")
    assert sorted(jobs) == sorted(task.name for task in TASKS), jobs
    for job in jobs.values():
        assert job["state"] == "paused", jobs
        assert job["reason"] == ("held: its run stopped before it ended (Ctrl-C, SIGTERM); `aspen demo` trains it "
                                 "anew (the demo starts its jobs over)"), jobs
    said = err.splitlines()[-1]
    assert said.startswith("aspen: interrupted; the running jobs were checkpointed, and `aspen demo` trains its "
                           "jobs anew"), err
    assert f"aspen status --from {tmp_path / 'demo'}" in said, err
    # what it says: `aspen demo` again trains the held jobs anew (to their end: 2 steps here, then the evaluation)
    code, out, err = finish(start_aspen(tmp_path, "demo", "--quiet", "--steps", "2", "--output-dir", "demo"),
                            timeout=600)
    assert "FAILED: job" not in out and "Traceback" not in err, (code, out, err)
    jobs = table_from(tmp_path, tmp_path / "demo")
    assert {name: (job["state"], job["step"]) for name, job in jobs.items()} == {
        task.name: ("completed", 2) for task in TASKS}, jobs
