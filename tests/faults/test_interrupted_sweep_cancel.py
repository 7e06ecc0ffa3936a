"""An interrupted `aspen sweep FILE` (its own service, Ctrl-C: its trial held paused in `<output_dir>/.aspen`) that a
file of the same name and other settings is refused against, got rid of through the real CLI (docs/sweeps.md,
"Ctrl-C"). Before, the refusal said "cancel it first", but `aspen sweep cancel NAME` found no service (none runs) and
the user had no way but deleting the state by hand. Now the refusal names `aspen sweep cancel NAME --from
OUTPUT_DIR`, which cancels it in that folder's state with no service: the held trial's job cancelled (as `aspen status
--from` shows it), the sweep `cancelled` in its leaderboard; then the new file replaces it and ends done, as the same
file alone under another name does (the reference)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.interrupted_runs import aspen, checkpoint_step, ctrl_c_once, finish, start_aspen, table_from
from tests.helpers.service import job_dict, write_task_data


@pytest.mark.long
def test_an_interrupted_sweep_is_cancelled_from_its_folder_and_a_new_file_replaces_it(tmp_path, tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "qa", rows=48)
    out = tmp_path / "out"
    old = {"name": "held", "base_model": str(tiny_model_dirs["llama"]), "output_dir": str(out), "step_tokens": 512,
           "job": {**job_dict("qa", data, 400), "checkpoint_every": 10}, "search": "grid", "max_concurrent": 1,
           "objective": "train_loss", "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    new = {**old, "job": {**old["job"], "max_steps": 4}, "space": {"lr": {"choice": [3e-3]}}}
    (tmp_path / "old.yaml").write_text(json.dumps(old))
    (tmp_path / "new.yaml").write_text(json.dumps(new))
    code, _, err = ctrl_c_once(start_aspen(tmp_path, "sweep", "old.yaml", "--poll", "0.2"),
                               lambda: checkpoint_step(out / "qa-t0") >= 10, "the trial to checkpoint")
    assert code == 130, err
    held = table_from(tmp_path, out)["qa-t0"]
    assert held["state"] == "paused", held

    code, _, err = finish(start_aspen(tmp_path, "sweep", "new.yaml", "--poll", "0.2"), timeout=300)
    assert code != 0
    told = f"aspen sweep cancel held --from {out}"
    assert "sweep 'held' exists with other settings (running)" in err and told in err, err
    without = aspen(tmp_path, "sweep", "cancel", "held")   # what did not work: no service runs
    assert without.returncode != 0

    cancelled = aspen(tmp_path, *told.split()[1:])
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.startswith("sweep held: cancelled"), cancelled.stdout
    assert table_from(tmp_path, out)["qa-t0"]["state"] == "cancelled"
    board = json.loads((out / "leaderboard.json").read_text())
    assert board["name"] == "held" and [t["state"] for t in board["trials"]] == ["cancelled"], board

    code, stdout, err = finish(start_aspen(tmp_path, "sweep", "new.yaml", "--poll", "0.2", "--json"), timeout=600)
    assert code == 0, err
    assert "aspen: sweep held (cancelled) had other settings and is replaced" in err, err
    replaced = json.loads(stdout[stdout.rindex("\n{\n") + 1:])
    (tmp_path / "alone.yaml").write_text(json.dumps({**new, "name": "alone", "output_dir": str(tmp_path / "alone")}))
    code, stdout, err = finish(start_aspen(tmp_path, "sweep", "alone.yaml", "--poll", "0.2", "--json"), timeout=600)
    assert code == 0, err
    alone = json.loads(stdout[stdout.rindex("\n{\n") + 1:])
    assert [(t["name"], t["state"], t["steps"]) for t in replaced["trials"]] == [
        (t["name"], t["state"], t["steps"]) for t in alone["trials"]] == [("qa-t0", "completed", 4)]
    assert replaced["trials"][0]["objective"] == pytest.approx(alone["trials"][0]["objective"], rel=1e-3)
