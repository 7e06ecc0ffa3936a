"""A job that trains again from step 0 (resumed where its checkpoint is gone, retried after failing before its first
checkpoint) shows in its record the tokens its model has seen, as its checkpoint's state.json counts them: not
those of the earlier attempt added to them (actors/service/events/event_booking.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from actors.service.scheduler.local_run import StopBetweenSteps, train_locally
from actors.service.table.job_table import JobTable, read_jobs
from actors.service.table.recorded_run import CarriedJobs
from tests.helpers.service import job_dict, run_spec, write_task_data

STEPS = 6


def test_a_job_resumed_without_its_checkpoint_counts_only_the_tokens_of_its_new_attempt(tmp_path, tiny_base,
                                                                                      tiny_model_dirs):
    """`aspen run --in-process` interrupted after 3 steps (the job checkpointed and recorded paused), its checkpoint
    deleted, and the run again: the job trains from step 0 to its end, and its record's tokens are its final
    checkpoint's tokens_seen and those of the same job run once undisturbed."""
    data = write_task_data(tmp_path / "data", "a")
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, STEPS)], step_tokens=512)
    state = tmp_path / "out/.aspen"
    stops, done = StopBetweenSteps(), []

    def stop_after_three(report) -> None:
        done.extend(result for result in report.results if result.optimizer_step is not None)
        if len(done) >= 3:
            stops.request(KeyboardInterrupt())

    with pytest.raises(KeyboardInterrupt):
        train_locally(spec, base=tiny_base, progress=False, on_step=stop_after_three, stops=stops, record_in=state)
    [(paused, _)] = read_jobs(state / "jobs.sqlite")
    assert paused.state == "paused" and paused.step == 3 and paused.tokens > 0, paused
    shutil.rmtree(tmp_path / "out/a/checkpoint")

    [summary] = train_locally(spec, base=tiny_base, progress=False, record_in=state,
                              carry=CarriedJobs(resume=[paused.id]))
    seen = json.loads((tmp_path / "out/a/checkpoint/state.json").read_text())["tokens_seen"]
    assert summary.state == "completed" and summary.steps == STEPS
    assert summary.tokens == seen, (summary.tokens, seen, paused.tokens)
    [(record, _)] = read_jobs(state / "jobs.sqlite")
    assert record.tokens == seen
    [undisturbed] = train_locally(spec.model_copy(update={"output_dir": tmp_path / "solo"}), base=tiny_base,
                                  progress=False)
    assert undisturbed.tokens == seen


def test_a_job_trained_again_from_step_0_shows_its_new_attempts_rows_only(tmp_path, tiny_base, tiny_model_dirs):
    """The same interrupted run, its checkpoint deleted, run again and interrupted after one step: the job's record
    holds that one step's row and loss (the earlier attempt's rows for steps 2 and 3 stayed until the new attempt
    wrote over them, and its evaluations' figures with them), as a run interrupted at its first step holds."""
    data = write_task_data(tmp_path / "data", "a")
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, STEPS, eval_every=2,
                                                                               eval_split=4)], step_tokens=512)
    state = tmp_path / "out/.aspen"

    def interrupted(steps: int, **carry) -> None:
        stops, done = StopBetweenSteps(), []

        def stop(report) -> None:
            done.extend(result for result in report.results if result.optimizer_step is not None)
            if len(done) >= steps:
                stops.request(KeyboardInterrupt())

        with pytest.raises(KeyboardInterrupt):
            train_locally(spec, base=tiny_base, progress=False, on_step=stop, stops=stops, record_in=state, **carry)

    interrupted(3)
    [(paused, _)] = read_jobs(state / "jobs.sqlite")
    assert paused.step == 3 and paused.eval_loss is not None
    table = JobTable(state / "jobs.sqlite")
    assert [row["step"] for row in table.progress.of_job(paused.id)] == [1, 2, 3]
    table.close()
    shutil.rmtree(tmp_path / "out/a/checkpoint")

    interrupted(1, carry=CarriedJobs(resume=[paused.id]))
    [(again, _)] = read_jobs(state / "jobs.sqlite")
    table = JobTable(state / "jobs.sqlite")
    rows = table.progress.of_job(again.id)
    table.close()
    assert again.step == 1 and [row["step"] for row in rows] == [1]
    assert again.loss == rows[0]["loss"] and again.eval_loss is None and again.checkpoint_step == 1
