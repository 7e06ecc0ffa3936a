"""A service killed (SIGKILL) in the middle of starting or stopping a sweep's trial, then started again on the same
state folder (tests/helpers/sweep_service.py: the scheduler's own sweep book, job table and recovery in a process of
its own, a planted trainer that ends the jobs it is asked to stop at its next tick). At each point, from the
searcher's suggestion to the state written after the trial's job was entered, and from a stop's cancel to the state
written after it: every trial has exactly one job in the job table, trained with the trial's settings and ended as
the same sweep's job ended without a kill (a stopped trial's job stopped, not trained on to its end), and the sweep
ends with the leaderboard of the sweep run without a kill (the reference); a model-based searcher (Optuna) gives the
same trials the same settings. Before, a kill after a trial's job was entered and before the state was written left
that job training unfollowed and failed the trial ('already writes to' its folder); a kill after a stop left its
job training to the end after the restart, or the trial `cancelled` rather than `stopped`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from actors.service.table.job_table import JobTable

ROOT = Path(__file__).resolve().parents[2]
JOB = {"name": "qa", "format": {"type": "alpaca"}, "max_steps": 8, "eval_split": 4, "eval_every": 2, "lr": 1e-3}
GRID = {"search": "grid", "max_concurrent": 2, "space": {"lr": {"choice": [1e-3, 3e-3, 1e-2]}}}
OPTUNA = {"search": "optuna", "trials": 4, "max_concurrent": 1, "seed": 3,
          "space": {"lr": {"loguniform": [1e-4, 1e-1]}}}
ASHA = {**GRID, "max_concurrent": 1, "stopping": {"asha": {"grace_steps": 2, "reduction": 2}}}   # t1, t2 stopped
SEARCHES = {"grid": GRID, "optuna": OPTUNA, "asha": ASHA}


def serve(folder: Path, *crash: str) -> tuple[int, dict | None]:
    """The service on `folder`'s state until the sweep ends (its status) or it is killed at `crash`."""
    status = folder / "status.json"
    status.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "tests.helpers.sweep_service", str(folder / "state"),
                           str(folder / "sweep.json"), str(status), *crash], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode in (0, -9), done.stderr
    return done.returncode, json.loads(status.read_text()) if done.returncode == 0 else None


def sweep(folder: Path, search: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    (folder / "sweep.json").write_text(json.dumps({"name": "lr", "output_dir": str(folder / "out"), "seed": 3,
                                                   "job": {**JOB, "data": str(folder / "qa.jsonl")}, **search}))
    return folder


def jobs_by_trial(folder: Path) -> Counter:
    return Counter(name for name, *_ in trained(folder))


def trained(folder: Path) -> list[tuple[str, float, str, int]]:
    """Each job of the job table: its name, the lr it trained with, how it ended and its steps."""
    table = JobTable(folder / "state" / "jobs.sqlite")
    try:
        return sorted((record.name, table.submission(record.id).job.lr, record.state, record.step)
                      for record in table.all())
    finally:
        table.close()


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory) -> dict[str, dict]:
    """Each search's sweep run without a kill (its status), each trial one job."""
    runs = {}
    for name, search in SEARCHES.items():
        if search is OPTUNA and importlib.util.find_spec("optuna") is None:
            continue
        folder = sweep(tmp_path_factory.mktemp("whole"), search)
        code, status = serve(folder)
        assert code == 0 and status["state"] == "done" and status["best"] is not None, status
        assert jobs_by_trial(folder) == Counter(t["name"] for t in status["trials"])
        runs[name] = {"status": status, "jobs": trained(folder)}
    return runs


@pytest.mark.parametrize(("search", "point"), [
    *((search, point) for search in ("grid", "optuna")
      for point in ("suggested", "before-submit", "after-submit", "after-save")),
    *(("asha", point) for point in ("stop-sent", "stop-landed", "stop-saved"))])
def test_a_service_killed_while_starting_or_stopping_a_trial_ends_the_sweep_as_unkilled(tmp_path, unkilled, search,
                                                                                      point):
    if search not in unkilled:
        pytest.skip("optuna is not installed (the sweep extra: pip install 'aspen-lora[sweep]')")
    reference = unkilled[search]["status"]
    folder = sweep(tmp_path / "killed", SEARCHES[search])
    code, _ = serve(folder, point, "2")   # the second trial: the first one's job entered (and, optuna, ended) before
    assert code == -9
    code, status = serve(folder)          # the same state folder: a restarted service
    assert code == 0, status
    trials = [t["name"] for t in reference["trials"]]
    assert jobs_by_trial(folder) == Counter(trials)          # each trial one job; none twice, none lost
    # each trial's settings are those its job trained with (a trial entered before the kill is not suggested again);
    # each job ended as the unkilled sweep's did, after as many steps (a stopped trial's job stopped, not trained on)
    assert trained(folder) == unkilled[search]["jobs"]
    assert {name: lr for name, lr, *_ in trained(folder)} == {t["name"]: t["settings"]["lr"] for t in status["trials"]}
    assert (status["state"], status["trials"], status["best"]) == ("done", reference["trials"], reference["best"])
    assert json.loads((folder / "out" / "leaderboard.json").read_text()) == {
        "name": "lr", "trials": reference["trials"], "best": reference["best"]}
