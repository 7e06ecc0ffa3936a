"""A failed sweep replaced by one of the same name and other settings, over a real service's HTTP API (docs/sweeps.md,
"Surviving"). Before, the replacement was accepted but each of its trials failed at once: the old sweep's trial jobs
(ended, in the job table) had written to the same folders (`<output_dir>/<trial>`), which the service refuses to
overwrite. Now: while the failed sweep's trial still trains, the replacement is refused naming its job; once that job
is cancelled, `aspen sweep FILE --url` replaces the sweep: the old one's leaderboard, report and trial folders move to
`<output_dir>/replaced-1/` with its jobs' output_dir (`aspen resume` continues the old trial from its checkpoint
there), the new sweep trains in `<output_dir>/<trial>` and ends with its own leaderboard, the one the same sweep run
alone under another name ends with (the reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.outputs.earlier_outputs import earlier_outputs
from tests.helpers.failed_sweeps import REPO, cli, failed_sweep
from tests.helpers.service import wait_for


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def rows(status: dict) -> list[tuple]:
    return [(t["name"], t["settings"], t["state"], t["steps"]) for t in status["trials"]]


@pytest.mark.long
def test_a_failed_sweep_is_replaced_its_results_moved_aside_and_the_new_one_ends_with_its_own(api, tmp_path):
    http, old, out, trial = failed_sweep(api, tmp_path, "repl", "FailsAtFirstResult", eval_every=4)
    new = {**old, "job": {**old["job"], "max_steps": 6, "eval_every": 3, "checkpoint_every": 100}, "search": "grid",
           "max_concurrent": 2, "space": {"lr": {"choice": [3e-3, 5e-4]}}}

    (tmp_path / "new.yaml").write_text(json.dumps(new))
    refused = cli(api, "sweep", str(tmp_path / "new.yaml"))   # its trial still writes to out/qa-t0
    assert refused.returncode != 0, refused.stdout
    assert (f"sweep 'repl' (failed) exists with other settings and its trials' jobs {trial.id} (running) still train "
            "in its folder; cancel them (aspen sweep cancel repl, or aspen cancel JOB)") in refused.stderr, \
        refused.stderr
    http.cancel(trial.id)
    ended = wait_for(lambda: (job := http.status(trial.id)).state == "cancelled" and job, 120, "the old trial's cancel")
    assert ended.checkpoint_step and ended.checkpoint_step > 0
    old_files = folder_files(out / "qa-t0")
    old_board = http.sweep_status("repl")

    replaced = cli(api, "sweep", str(tmp_path / "new.yaml"), "--json", "--poll", "0.2")
    assert replaced.returncode == 0, replaced.stderr
    assert (f"aspen: sweep repl (failed) had other settings and is replaced: its leaderboard, report and trial folders "
            f"were moved to {out / 'replaced-1'} (its trials' jobs {trial.id} with them") in replaced.stderr
    board = json.loads(replaced.stdout[replaced.stdout.rindex("\n{\n") + 1:])
    status = http.sweep_status("repl")
    assert status["state"] == "done" and board == {"trials": status["trials"], "best": status["best"]}
    assert json.loads((out / "leaderboard.json").read_text()) == {"name": "repl", **board}

    # the reference: the same sweep alone, under another name and folder, on the same service
    assert http.sweep({**new, "name": "alone", "output_dir": str(tmp_path / "alone")})["state"] == "running"
    alone = wait_for(lambda: (found := http.sweep_status("alone"))["state"] == "done" and found, 180,
                     "the reference sweep")
    assert rows(status) == rows(alone) and [t["state"] for t in status["trials"]] == ["completed"] * 2
    assert [t["objective"] for t in status["trials"]] == pytest.approx([t["objective"] for t in alone["trials"]],
                                                                       rel=1e-3)
    assert status["best"] == alone["best"]
    for row in status["trials"]:   # the new trials' folders: their own jobs' outputs
        (job,) = [j for j in http.jobs() if j.output_dir == str(out / row["name"])]
        assert job.state == "completed" and earlier_outputs(out / row["name"]).step == 6
    new_files = folder_files(out / "qa-t0")

    # the old sweep's results, where the doc says: its trial folder untouched, its leaderboard, its job
    moved = out / "replaced-1"
    assert folder_files(moved / "qa-t0") == old_files
    kept = json.loads((moved / "leaderboard.json").read_text())
    assert kept["replaced"]["state"] == "failed" and kept["replaced"]["jobs"] == {"qa-t0": trial.id}
    assert [(t["name"], t["settings"]) for t in kept["trials"]] == [(t["name"], t["settings"])
                                                                   for t in old_board["trials"]]
    assert kept["trials"][0]["state"] == "cancelled" and kept["trials"][0]["steps"] >= ended.checkpoint_step
    assert http.status(trial.id).output_dir == str(moved / "qa-t0")
    shown = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", "status", str(moved)], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "qa-t0" in shown.stdout and "cancelled" in shown.stdout, shown.stderr
    resumed = http.resume(trial.id)   # the old trial goes on from its checkpoint in its new folder
    assert f"resumes from its checkpoint at step {ended.checkpoint_step}" in resumed.reason, resumed.reason
    http.cancel(trial.id)
    wait_for(lambda: http.status(trial.id).state == "cancelled", 120, "the resumed old trial's cancel")
    assert folder_files(out / "qa-t0") == new_files   # the new trial's folder untouched by the old trial's resume
