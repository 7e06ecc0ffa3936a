"""`aspen sweep FILE` (a service of its own, its state in `<output_dir>/.aspen`) whose searcher raised, then `aspen
sweep` of a file of the same name and output_dir with another space (docs/sweeps.md, "Surviving"). Before, the second
command's service carried the failed sweep on (its failure was not kept) and resumed its held trial: the new file
was refused as a running sweep's other settings, or, where the carried-on sweep had failed again first, accepted
with its first trial refused its folder ("job ... (running) already writes to out/qa-t0"; seen without the fix).
Now the failed sweep is replaced:
its held trial cancelled and moved with its folder to `<output_dir>/replaced-1/`, the new sweep ends with the
leaderboard the same file gives run alone in a fresh folder (the reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.service.table.job_table import JobTable
from tests.helpers.service import job_dict, write_task_data

REPO = Path(__file__).resolve().parents[2]


def aspen(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=folder, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO),
                                                       "ASPEN_RECENT_RUNS": str(folder / "runs.json")})


def board_of(out: str) -> dict:
    return json.loads(out[out.rindex("\n{\n") + 1:])


@pytest.mark.long
def test_aspen_sweep_of_other_settings_replaces_its_failed_sweep(tmp_path, tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "qa", rows=24)
    old = {"name": "repl", "base_model": str(tiny_model_dirs["llama"]), "output_dir": "out", "step_tokens": 512,
           "job": {**job_dict("qa", data, 400, eval_split=4, eval_every=4), "checkpoint_every": 4},
           "search": "tests.helpers.searchers:FailsAtFirstResult", "trials": 2, "max_concurrent": 1,
           "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    new = {**old, "job": {**old["job"], "max_steps": 6, "eval_every": 3, "checkpoint_every": 100}, "search": "grid",
           "max_concurrent": 2, "space": {"lr": {"choice": [3e-3, 5e-4]}}}
    (tmp_path / "old.yaml").write_text(json.dumps(old))   # JSON is YAML
    (tmp_path / "new.yaml").write_text(json.dumps(new))
    failed = aspen(tmp_path, "sweep", "old.yaml", "--poll", "0.2")
    assert failed.returncode == 1 and "planted searcher failure" in failed.stderr, failed.stderr
    table = JobTable(tmp_path / "out" / ".aspen" / "jobs.sqlite")
    (held,) = table.all()
    table.close()
    assert held.state == "paused", held   # held as its service stopped

    replaced = aspen(tmp_path, "sweep", "new.yaml", "--poll", "0.2", "--json")
    assert replaced.returncode == 0, replaced.stderr
    moved = tmp_path / "out" / "replaced-1"
    assert (f"aspen: sweep repl (failed) had other settings and is replaced: its leaderboard, report and trial folders "
            f"were moved to {moved} (its trials' jobs {held.id} with them") in replaced.stderr, replaced.stderr
    board = board_of(replaced.stdout)
    assert json.loads((tmp_path / "out" / "leaderboard.json").read_text()) == {"name": "repl", **board}

    (tmp_path / "alone").mkdir()
    (tmp_path / "alone" / "new.yaml").write_text(json.dumps(new))
    alone = aspen(tmp_path / "alone", "sweep", "new.yaml", "--poll", "0.2", "--json")
    assert alone.returncode == 0, alone.stderr
    reference = board_of(alone.stdout)
    assert [(t["name"], t["settings"], t["state"], t["steps"]) for t in board["trials"]] == [
        (t["name"], t["settings"], t["state"], t["steps"]) for t in reference["trials"]]
    assert [t["objective"] for t in board["trials"]] == pytest.approx([t["objective"] for t in reference["trials"]],
                                                                      rel=1e-3)
    assert board["best"] == reference["best"] and {t["state"] for t in board["trials"]} == {"completed"}

    table = JobTable(tmp_path / "out" / ".aspen" / "jobs.sqlite")
    try:
        record = table.get(held.id)
    finally:
        table.close()
    assert record.state == "cancelled" and record.output_dir == str(moved / "qa-t0")   # not resumed by the new run
    assert (moved / "qa-t0" / "checkpoint").is_dir()
    kept = json.loads((moved / "leaderboard.json").read_text())
    assert kept["replaced"] == {**kept["replaced"], "state": "failed", "jobs": {"qa-t0": held.id}}
    assert kept["trials"][0]["name"] == "qa-t0" and kept["trials"][0]["state"] == "cancelled"
