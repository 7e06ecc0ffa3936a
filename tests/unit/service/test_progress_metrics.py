"""A step's method metrics (a GRPO job's rewards, a preference job's margins: what its metrics.jsonl row has beyond
loss, tokens, lr and grad norm) kept in the job table's progress rows and read back beside the columns, as
`aspen losses` (a reward or margin column), the HTTP API and the console read them; a table an older aspen wrote
gains the column, and one opened read-only without it reads as before."""

from __future__ import annotations

import argparse
import sqlite3

import pytest

from actors.service.table.job_table import JobTable
from actors.service.table.progress_rows import progress_of

ROW = {"step": 1, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "reward": 0.25, "reward_std": 0.1,
       "rewards/sevens/mean": 0.5, "clip_ratio/region_mean": 0.0, "tokens_per_s": 123.0, "total_steps": 9}


def test_a_steps_method_metrics_are_kept_beside_its_columns(tmp_path):
    table = JobTable(tmp_path / "jobs.sqlite")
    table.progress.add("j", ROW)
    table.progress.add("j", {"step": 2, "loss": 0.4, "tokens": 40, "lr": 1e-3, "grad_norm": 0.6})   # an sft row
    table.progress.add_eval("j", 1, 1.5, 0.75)
    first, second = table.progress.of_job("j")
    assert {k: v for k, v in first.items() if k != "time"} == {
        "step": 1, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "eval_loss": 1.5, "eval_score": 0.75,
        "reward": 0.25, "reward_std": 0.1, "rewards/sevens/mean": 0.5, "clip_ratio/region_mean": 0.0}
    assert "reward" not in second and second["loss"] == 0.4   # a row without metrics has none
    table.close()


def test_a_table_without_the_metrics_column_gains_it_and_reads_read_only_as_before(tmp_path):
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE progress (job_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL, tokens INTEGER, "
               "lr REAL, grad_norm REAL, eval_loss REAL, eval_score REAL, time REAL NOT NULL, "
               "PRIMARY KEY (job_id, step))")
    db.execute("INSERT INTO progress VALUES ('j', 1, 2.5, 10, 0.001, 1.0, 2.7, NULL, 0)")
    db.commit()
    db.close()
    readonly = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)   # as `aspen losses --from` reads a run
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in progress_of(readonly, "j")] == [(1, 2.5, 2.7)]
    readonly.close()
    table = JobTable(path)   # opened for writing: the column is added
    table.progress.add("j", {**ROW, "step": 2})
    assert [r.get("reward") for r in table.progress.of_job("j")] == [None, 0.25]
    table.close()


@pytest.mark.parametrize(("key", "title"), [("reward", "reward"), ("rewards/margins", "margin")])
def test_aspen_losses_shows_a_grpo_jobs_reward_and_a_preference_jobs_margin(monkeypatch, capsys, key, title):
    from orchestrator.cli import service_commands

    rows = [{"step": step, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "eval_loss": None,
             "eval_score": None, key: value} for step, value in ((1, 0.25), (2, 0.5))]

    class Ended:
        @staticmethod
        def losses(job):
            return rows

    monkeypatch.setattr(service_commands, "_service_or_ended_run", lambda args: Ended())
    service_commands.cmd_losses(argparse.Namespace(job="j", json=False))
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:5] == ["step", "loss", "eval", "loss", title] and "eval score" not in lines[0]
    assert [line.split()[3] for line in lines[1:]] == ["0.2500", "0.5000"]
