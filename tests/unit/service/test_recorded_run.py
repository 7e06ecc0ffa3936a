"""An in-process run's jobs recorded in the run folder's job table (`recorded_run.record_run`): read back through
the table as `aspen run`, `aspen status` and `aspen report` read it (the table's own reader and plain SQL), into a
table an older aspen wrote (its added columns at the end), in place of the jobs that wrote to the same folders,
with the other jobs there left as they were; an unfinished job recorded paused, with no trainer. Carried on by the
next run (`carry_on`): the done jobs as they were, the resumed ones queued, each with its history; the folder's
table read as it is, and a damaged one refused with its message."""

from __future__ import annotations

import sqlite3

import pytest

from actors.service.table.job_table import JobTable, read_jobs
from actors.service.table.recorded_run import CarriedJobs, carry_on, earlier_jobs, record_run
from actors.service.table.table_backup import JobTableDamaged
from actors.service.table.table_schema import ADDED_COLUMNS, SCHEMA
from tests.helpers.service import job_dict, run_spec, write_task_data


def _run_table(tmp_path, name: str, jobs: list[str]):
    """A run's own table (as the in-process run keeps it) with `jobs` submitted under their names as ids."""
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(job, data, 100) for job in jobs])
    table = JobTable(tmp_path / name / "jobs.sqlite")
    for submission in spec.submissions():
        table.add(submission.job.name, submission, submission.output_dir)
    return table


def _older_table(path) -> None:
    """A job table as an aspen before the added columns wrote it (they are appended when it opens)."""
    schema = SCHEMA
    for _, column, kind in ADDED_COLUMNS:
        schema = schema.replace(f",\n    {column} {kind}", "").replace(f", {column} {kind}", "")
    path.parent.mkdir(parents=True)
    db = sqlite3.connect(path)
    db.executescript(schema)
    db.close()


def test_the_runs_jobs_replace_those_of_the_same_folders_and_the_rest_stay(tmp_path):
    earlier = _run_table(tmp_path, "earlier", ["a", "other"])
    earlier.set_state("a", "failed", "an earlier run")
    earlier.progress.add("a", {"step": 1, "loss": 9.0, "tokens": 5, "lr": 1e-3, "grad_norm": 1.0})
    record_run(earlier, ["a", "other"], tmp_path / "run" / "jobs.sqlite")

    run = _run_table(tmp_path, "in-process", ["a", "b"])
    run.set_state("a", "running", "training on in-process", trainer="in-process", step=2)
    run.set_state("a", "completed", "trained 2 of 2 steps", eval_score=0.75, eval_loss=1.5, tokens=40)
    for step, loss in ((1, 3.0), (2, 2.5)):
        run.progress.add("a", {"step": step, "loss": loss, "tokens": 20, "lr": 1e-3, "grad_norm": 0.5})
    run.set_state("b", "running", "training on in-process", trainer="in-process", checkpoint_step=1)
    record_run(run, ["a", "b"], tmp_path / "run" / "jobs.sqlite")

    kept = {record.id: record for record, _ in read_jobs(tmp_path / "run" / "jobs.sqlite")}
    assert set(kept) == {"a", "b", "other"}
    a = kept["a"]
    assert (a.state, a.eval_score, a.eval_loss, a.tokens) == ("completed", 0.75, 1.5, 40)
    assert (kept["other"].state, kept["other"].reason) == ("paused", "left by an in-process run (submitted)")
    assert kept["b"].state == "paused" and kept["b"].trainer is None and kept["b"].checkpoint_step == 1
    assert "left by an in-process run (training on in-process)" in kept["b"].reason
    db = sqlite3.connect(tmp_path / "run" / "jobs.sqlite")
    # the earlier run's progress of the same folder is gone; the run's own, and its history, are there
    assert db.execute("SELECT step, loss FROM progress WHERE job_id = 'a' ORDER BY step").fetchall() == [
        (1, 3.0), (2, 2.5)]
    assert [state for (state,) in db.execute("SELECT state FROM transitions WHERE job_id = 'a' ORDER BY rowid")] == [
        "queued", "running", "completed"]


def test_into_a_table_an_older_aspen_wrote_each_value_lands_in_its_own_column(tmp_path):
    target = tmp_path / "run" / "jobs.sqlite"
    _older_table(target)
    run = _run_table(tmp_path, "in-process", ["a"])
    run.set_state("a", "completed", "done", eval_score=0.25)
    run.db.execute("UPDATE jobs SET step_seconds = 3.5, account_tokens = 7, user = 'ann'")
    run.progress.add_eval("a", 1, 2.0, 0.5)
    record_run(run, ["a"], target)

    (record, submission), = read_jobs(target)
    assert (record.state, record.eval_score, record.user) == ("completed", 0.25, "ann")
    assert submission.job.name == "a"
    db = sqlite3.connect(target)
    assert db.execute("SELECT step_seconds, account_tokens, gpu_seconds FROM jobs").fetchall() == [(3.5, 7, 0.0)]
    assert db.execute("SELECT step, eval_loss, eval_score FROM progress").fetchall() == [(1, 2.0, 0.5)]


def test_a_run_that_ended_before_any_step_is_recorded(tmp_path):
    """No progress rows at all (the run failed or was stopped before its first step): its jobs recorded paused."""
    run = _run_table(tmp_path, "in-process", ["a"])
    record_run(run, ["a"], tmp_path / "run" / "jobs.sqlite")
    record_run(run, [], tmp_path / "run" / "jobs.sqlite")   # and a run of no job changes nothing
    (record, _), = read_jobs(tmp_path / "run" / "jobs.sqlite")
    assert (record.id, record.state, record.step) == ("a", "paused", 0)


def test_the_next_run_carries_on_done_jobs_as_they_were_and_resumes_the_others_with_their_history(tmp_path):
    earlier = _run_table(tmp_path, "earlier", ["done", "paused", "failed", "other"])
    earlier.set_state("done", "completed", "trained 3 of 3 steps", step=3, tokens=60, eval_loss=1.25)
    earlier.set_state("paused", "paused", "the trainer is shutting down", step=2, checkpoint_step=2)
    earlier.set_state("failed", "failed", "a reward raised")
    for step, loss in ((1, 3.0), (2, 2.5)):
        earlier.progress.add("paused", {"step": step, "loss": loss, "tokens": 20, "lr": 1e-3, "grad_norm": 0.5})
    folder = tmp_path / "run" / "jobs.sqlite"
    record_run(earlier, ["done", "paused", "failed", "other"], folder)
    before = folder.read_bytes()

    assert [record.id for record, _ in earlier_jobs(folder)] == ["done", "paused", "failed", "other"]
    assert earlier_jobs(tmp_path / "none" / "jobs.sqlite") == []
    run = JobTable(tmp_path / "next" / "jobs.sqlite")
    carry_on(folder, run, CarriedJobs(done=["done"], resume=["paused", "failed"]), "resumed by a test")

    assert sorted(record.id for record in run.all()) == ["done", "failed", "paused"]   # "other" not carried
    done = run.get("done")
    assert (done.state, done.step, done.tokens, done.eval_loss) == ("completed", 3, 60, 1.25)
    paused, failed = run.get("paused"), run.get("failed")
    assert (paused.state, paused.trainer, paused.step) == ("queued", None, 2)
    assert paused.reason == "resumed by a test; resumes from its checkpoint at step 2"
    assert (failed.state, failed.reason) == ("queued", "resumed by a test; resumes from the start")
    assert [(row["step"], row["loss"]) for row in run.progress.of_job("paused")] == [(1, 3.0), (2, 2.5)]
    assert run.submission("paused") == earlier.submission("paused")
    assert folder.read_bytes() == before   # the folder's table only read


def test_a_damaged_table_in_the_run_folder_is_refused_with_its_message(tmp_path):
    folder = tmp_path / "run" / "jobs.sqlite"
    folder.parent.mkdir()
    folder.write_bytes(b"not a database" * 300)
    with pytest.raises(JobTableDamaged, match="is damaged"):
        earlier_jobs(folder)
