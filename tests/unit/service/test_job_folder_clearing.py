"""A job that starts over in a folder an earlier run wrote (`aspen run --in-process`, `--overwrite`, the demo) clears
that run's outputs, and only those: a user's own files there (notes, a data folder the job's name happened to
match) were deleted with them. The reference for what the new run leaves is a run in an empty folder."""

from __future__ import annotations

import json

import pytest

from actors.service.outputs.job_files import aspen_output, clear_job_folder
from actors.service.scheduler.local_run import train_locally
from tests.helpers.service import adapter_tensors, job_dict, run_spec, write_task_data

pytestmark = pytest.mark.unit


def test_starting_over_clears_the_earlier_runs_outputs_and_keeps_the_users_files(tmp_path, tiny_model_dirs):
    base = str(tiny_model_dirs["llama"])
    data = write_task_data(tmp_path / "rows", "sql")
    train_locally(run_spec(base, tmp_path / "out", [job_dict("sql", data, 3, checkpoint_every=1,
                                                             tracking={"tensorboard": True})]), progress=False)
    folder = tmp_path / "out" / "sql"
    assert (folder / "checkpoint").is_dir() and (folder / "metrics.jsonl").is_file() and (folder / "tb").is_dir()
    (folder / "notes.txt").write_text("what I tried\n")
    (folder / "data").mkdir()
    (folder / "data" / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (folder / ".git").mkdir()   # a hidden entry aspen does not write
    (folder / ".checkpoint.previous").mkdir()   # one it does (a checkpoint swapped out)
    (folder / ".metrics.jsonl.0a1b2c.tmp").write_text("")

    train_locally(run_spec(base, tmp_path / "out", [job_dict("sql", data, 2)]), progress=False)
    train_locally(run_spec(base, tmp_path / "fresh", [job_dict("sql", data, 2)]), progress=False)
    assert (folder / "notes.txt").read_text() == "what I tried\n"
    assert (folder / "data" / "train.jsonl").is_file() and (folder / ".git").is_dir()
    ours = sorted(path.name for path in folder.iterdir() if aspen_output(path.name))
    assert ours == sorted(path.name for path in (tmp_path / "fresh" / "sql").iterdir())   # as a run in an empty one
    assert "tb" not in ours   # the first run's TensorBoard events, which a run started over would add its own to
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    fresh = adapter_tensors(tmp_path / "fresh" / "sql")
    assert all((adapter_tensors(folder)[key] == tensor).all() for key, tensor in fresh.items())

    clear_job_folder(folder)
    assert sorted(path.name for path in folder.iterdir()) == [".git", "data", "notes.txt"]
