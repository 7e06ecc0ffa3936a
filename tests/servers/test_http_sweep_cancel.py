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
from pathlib import Path

import pytest

from tests.helpers.failed_sweeps import cli, failed_sweep
from tests.helpers.service import wait_for


@pytest.mark.long
def test_a_failed_sweep_is_cancelled_and_its_replacement_says_what_it_replaced(api, tmp_path):
    http, old, out, trial = failed_sweep(api, tmp_path, "broke", "FailsAtEveryWord", eval_every=2)

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
