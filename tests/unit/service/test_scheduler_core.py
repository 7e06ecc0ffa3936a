"""The scheduler core's memory of a job beside the job table, without Ray: a deleted job is forgotten whole,
so that a job entered again under the same client-chosen id starts with nothing of its predecessor (its
retries, a stop rule's prediction, a move under way)."""

from __future__ import annotations

import dataclasses

import pytest

from actors.service.events.event_booking import MAX_RETRIES
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.base import Start
from policies.fifo import FifoPolicy
from tests.helpers.scheduler_fakes import status
from tests.helpers.service import job_dict, run_spec, write_task_data


def test_a_deleted_job_is_forgotten_whole_and_its_id_starts_afresh(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("again", data, 100)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")

    def start_and_give_back() -> str:
        with core.table.transaction():
            assert core.plan([status("trainer-0")]) == [Start(job="same", trainer="trainer-0")]
            core.apply_event("trainer-0", TrainerEvent(kind="started", job_id="same", step=0,
                                                       data={"total_steps": 100}))
            core.apply_event("trainer-0", TrainerEvent(kind="prediction", job_id="same", step=10,
                                                       data={"predicted_stop_step": 40}))
        with core.table.transaction():
            core.apply_event("trainer-0", TrainerEvent(kind="paused", job_id="same", step=10, data={"retry": True,
                                                                              "reason": "its job actor was lost"}))
        return core.table.get("same").reason

    core.submit_many(spec.submissions(), job_ids=["same"])
    assert "(retry 1 of" in start_and_give_back()
    assert f"(retry 2 of {MAX_RETRIES})" in start_and_give_back()
    [view] = core.snapshot([status("trainer-0")]).jobs
    assert view.predicted_remaining_steps == 30
    core.delete("same")
    assert core.table.all() == []
    core.submit_many(spec.submissions(), job_ids=["same"])
    [view] = core.snapshot([status("trainer-0")]).jobs
    assert view.predicted_remaining_steps is None and view.moving_to is None and not view.preempting
    assert f"(retry 1 of {MAX_RETRIES})" in start_and_give_back()   # not the predecessor's third


def test_trainers_with_automatic_step_tokens_check_a_micro_batch_against_the_floor_then_the_planned_step(tmp_path):
    """`step_tokens: auto` (the default of a trainer's config): before a trainer has planned its steps a
    micro-batch is checked against auto's floor (it raised a TypeError comparing with 'auto'); once one
    reports the step it planned, against that."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.submissions import SubmissionError

    data = write_task_data(tmp_path / "data", "t")
    trainer = TrainerConfig(base_model="smollm2-135m")
    assert trainer.step_tokens == "auto"
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state",
                         trainers=[trainer])
    small = run_spec("smollm2-135m", tmp_path / "out", [job_dict("small", data, 5)])   # 4 x 128 tokens
    core.submit_many(small.submissions(), job_ids=["small"])
    wide = run_spec("smollm2-135m", tmp_path / "out", [{**job_dict("wide", data, 5), "batch_size": 48}],
                    step_tokens=8192)   # the file's own steps hold it; the service's trainers decide
    with pytest.raises(SubmissionError, match=r"48 \* max_seq_len 128 = 6144 tokens .*exceeds step_tokens 4096"):
        core.submit_many(wide.submissions(), job_ids=["wide"])
    core.statuses = {"trainer-0": dataclasses.replace(status("trainer-0"), step_tokens=8192)}   # planned on a GPU
    core.submit_many(wide.submissions(), job_ids=["wide"])
    assert [record.id for record in core.table.all()] == ["small", "wide"]


def test_work_reported_after_a_job_was_ended_beside_its_trainer_is_booked_once(tmp_path):
    """An interactive job is completed by its front (the HTTP server) while its trainer's reports of the last
    optimizer steps and checkpoints may still be on their way: they are booked after the end, each once; a
    cancelled job's late reports are not."""
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("model", data, 100), job_dict("gone", data, 100)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    core.submit_many(spec.submissions(), job_ids=["model", "gone"])

    def report(job: str, kind: str, step: int, **data) -> None:   # a progress report's data is its row
        row = {"step": step, **data} if kind == "progress" else data
        with core.table.transaction():
            core.apply_event("trainer-0", TrainerEvent(kind=kind, job_id=job, step=step, data=row))

    for job in ("model", "gone"):
        report(job, "started", 0, total_steps=100)
        report(job, "progress", 1, loss=2.0, tokens=10)
    with core.table.transaction():
        core.interactive.close("model", "completed", "its session ended", adapter_dir=str(tmp_path / "final"))
        core.interactive.close("gone", "cancelled", "cancelled by its user")
    report("model", "progress", 2, loss=1.5, tokens=12)
    report("model", "checkpoint", 2)
    report("model", "progress", 2, loss=1.5, tokens=12)   # the same report again: booked once
    report("model", "checkpoint", 1)                      # an older checkpoint: not the newest
    report("gone", "progress", 2, loss=1.0, tokens=12)
    report("gone", "checkpoint", 2)
    model, gone = core.table.get("model"), core.table.get("gone")
    assert (model.state, model.reason, model.adapter_dir) == ("completed", "its session ended", str(tmp_path / "final"))
    assert (model.step, model.tokens, model.loss, model.checkpoint_step) == (2, 22, 1.5, 2)
    assert [(row["step"], row["loss"]) for row in core.table.progress.of_job("model")] == [(1, 2.0), (2, 1.5)]
    assert (gone.state, gone.step, gone.tokens, gone.checkpoint_step) == ("cancelled", 1, 10, None)
    assert [row["step"] for row in core.table.progress.of_job("gone")] == [1]


def test_a_name_two_jobs_have_is_a_conflict_not_an_unknown_job(tmp_path):
    """A finished job's name may be taken again (in another folder): asked for by that name, the service says which
    jobs have it (its id to give), and the HTTP API answers 409, where it answered 404 as for a job that does not
    exist; the error survives the trip through Ray (pickled), and an unknown name stays a 404."""
    import pickle

    from actors.service.table.job_table import AmbiguousJobName
    from orchestrator.service_calls import as_http

    data = write_task_data(tmp_path / "data", "t")
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")
    first = core.submit(run_spec("smollm2-135m", tmp_path / "one", [job_dict("a", data, 5)]).submissions()[0])
    core.table.set_state(first.id, "completed", "trained 5 of 5 steps")
    again = core.submit(run_spec("smollm2-135m", tmp_path / "two", [job_dict("a", data, 5)]).submissions()[0])
    with pytest.raises(AmbiguousJobName) as ambiguous:
        core.table.find("a")
    assert str(ambiguous.value) == f"2 jobs are named 'a' ({first.id}, {again.id}); give the job id"
    answer = as_http(pickle.loads(pickle.dumps(ambiguous.value)))
    assert (answer.status_code, answer.detail) == (409, str(ambiguous.value))
    assert core.table.find(again.id).id == again.id
    with pytest.raises(KeyError) as unknown:
        core.table.find("b")
    assert as_http(unknown.value).status_code == 404
