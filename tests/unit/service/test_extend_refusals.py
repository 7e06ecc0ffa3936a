"""`SchedulerCore.extend` (aspen extend, POST /v1/jobs/{job}/extend) refuses, saying why and what to do, what a raised
max_steps or epochs would not continue: a job whose `epochs` ended it before its `max_steps` (it was queued again,
said to continue from its checkpoint, and ended at once at the same step having trained nothing; the step the epochs
end at is `planned_steps`', what a trainer plans), and a job whose checkpoint was deleted from its folder (it was
said to continue from its checkpoint and trained again from step 0, its metrics rewritten; the checkpoints are those
a trainer writes, `train_locally`'s). A job its max_steps bound, epochs or not, with its checkpoint, is queued, with
the remaining work of its new budget (not none, as its old total had it)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest

from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from actors.spec.job_spec import planned_steps
from policies.base import Start
from policies.fifo import FifoPolicy
from tests.helpers.scheduler_fakes import BUSY_S, status
from tests.helpers.service import job_dict, run_spec, write_task_data

TRAIN_ROWS = 10


def _ended(tmp_path, jobs: list[dict], base_model: str = "smollm2-135m", trained=None) -> tuple[SchedulerCore, list]:
    """A core whose jobs started (planning `planned_steps` of TRAIN_ROWS rows) and completed at that step, with a
    checkpoint there; `trained(spec)`, where given, writes the jobs' folders before they are booked as ended."""
    spec = run_spec(base_model, tmp_path / "out", jobs)
    table = JobTable(tmp_path / "state/jobs.sqlite", busy_timeout=BUSY_S)
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state")
    submissions = spec.submissions()
    ids = [r.id for r in core.submit_many(submissions)]
    if trained is not None:
        trained(spec)
    with table.transaction():
        trainer = dataclasses.replace(status("trainer-0"), base_model=base_model)
        assert core.plan([trainer]) == [Start(job=i, trainer="trainer-0") for i in ids]
        for job_id, submission in zip(ids, submissions, strict=True):
            total = planned_steps(submission.job, TRAIN_ROWS)
            core.apply_event("trainer-0", TrainerEvent(kind="started", job_id=job_id, step=0,
                                                       data={"total_steps": total}))
            core.apply_event("trainer-0", TrainerEvent(kind="completed", job_id=job_id, step=total,
                                                       data={"reason": f"trained {total} of {total} steps",
                                                             "checkpoint_step": total}))
    return core, submissions


def _raised(submission, steps: int):
    return submission.model_copy(update={"job": submission.job.model_copy(update={"max_steps": steps})})


def test_a_job_its_epochs_ended_before_its_max_steps_is_refused_and_one_its_max_steps_ended_continues(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    core, (by_epochs, by_steps) = _ended(tmp_path, [
        job_dict("by-epochs", data, 100, epochs=1, batch_size=2),    # 1 epoch of 10 rows: 5 steps, before 100
        job_dict("by-steps", data, 3, epochs=1, batch_size=2)])      # 3 steps, before the epoch's 5
    assert planned_steps(by_epochs.job, TRAIN_ROWS) == 5 < by_epochs.job.max_steps
    with pytest.raises(ValueError, match=r"bound by epochs: its 1 epoch\(s\) of data ended it at step 5, before its "
                                         r"max_steps 100.*start a new job \(init_adapter: job:NAME"):
        core.extend("by-epochs", _raised(by_epochs, 200))
    record = core.table.find("by-epochs")
    assert record.state == "completed" and core.table.submission(record.id).job.max_steps == 100

    queued = core.extend("by-steps", _raised(by_steps, 4))
    assert queued.state == "queued" and "max_steps 3 -> 4" in queued.reason
    assert core.table.submission(queued.id).job.max_steps == 4


def test_a_job_whose_checkpoint_was_deleted_is_refused_and_one_with_its_checkpoint_continues(tmp_path, tiny_base,
                                                                                            tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "t")
    jobs = [job_dict(name, data, 2, batch_size=2) for name in ("kept", "deleted")]
    core, (kept, deleted) = _ended(tmp_path, jobs, str(tiny_model_dirs["llama"]),
                                   lambda spec: train_locally(spec, base=tiny_base, progress=False))
    checkpoint = tmp_path / "out" / "deleted" / "checkpoint"
    assert checkpoint.is_dir()
    shutil.rmtree(checkpoint)
    with pytest.raises(ValueError, match=f"its checkpoint at step 2 is no longer in {checkpoint} .deleted, moved or "
                                         "damaged., so it would train again from step 0, not on from step 2; put "
                                         "the checkpoint back and extend it again, or submit it as a new job"):
        core.extend("deleted", _raised(deleted, 4))
    record = core.table.find("deleted")
    assert record.state == "completed" and core.table.submission(record.id).job.max_steps == 2

    queued = core.extend("kept", _raised(kept, 4))
    assert queued.state == "queued" and "continues from its checkpoint at step 2" in queued.reason

    # `aspen resume` likewise: it was queued "resumes from its checkpoint at step 2" and trained from step 0
    core.table.set_state(record.id, "failed", "its trainer died")
    with pytest.raises(ValueError, match=f"its checkpoint at step 2 is no longer in {checkpoint} .deleted, moved or "
                                         "damaged., so it would train again from step 0, not on from step 2; put "
                                         "the checkpoint back and resume it again, or submit it as a new job"):
        core.resume("deleted")
    assert core.table.find("deleted").state == "failed"


def _budget(submission, **budget):
    return submission.model_copy(update={"job": submission.job.model_copy(update=budget)})


def test_a_raised_epochs_continues_a_job_its_epochs_ended_and_each_budget_it_cannot_continue_to_is_refused(tmp_path):
    """`aspen extend JOB --epochs N` (`SchedulerCore.extend` with the job's spec, its epochs raised): a job its
    epochs ended is queued again, said to continue from its checkpoint; epochs raised alone on a job its max_steps
    ended (it would train nothing), epochs lowered, and epochs added to a job that had none (its data repeated until
    max_steps: another data order) are refused, saying why and what to do, the job left as it was."""
    data = write_task_data(tmp_path / "data", "t")
    core, (alone, capped, steps_only, twice) = _ended(tmp_path, [
        job_dict("alone", data, None, epochs=1, batch_size=2),    # 1 epoch of 10 rows: 5 steps
        job_dict("capped", data, 3, epochs=1, batch_size=2),      # 3 steps, before the epoch's 5
        job_dict("steps-only", data, 3, batch_size=2),
        job_dict("twice", data, None, epochs=2, batch_size=2)])
    queued = core.extend("alone", _budget(alone, epochs=2))
    assert queued.state == "queued" and "epochs 1 -> 2; continues from its checkpoint at step 5" in queued.reason
    assert core.table.submission(queued.id).job.epochs == 2

    refusals = [
        ("capped", _budget(capped, epochs=2), r"is bound by max_steps: its max_steps 3 ended it before its 1 epoch.s. "
                                              r"of data did, so a larger epochs alone would train nothing more; raise "
                                              r"max_steps too \(aspen extend JOB --max-steps N --epochs N"),
        ("steps-only", _budget(steps_only, epochs=1), r"epochs added \(1\) to a job that had none: its data was "
                                                      r"repeated until its max_steps.*a different data order.*raise "
                                                      r"max_steps to continue it, or start a new job"),
        ("twice", _budget(twice, epochs=1), r"epochs lowered 2 -> 1: a job continues from its checkpoint only to a "
                                            r"larger budget; give epochs above 2, or start a new job"),
        ("twice", _budget(twice, epochs=3, max_steps=50), r"bound by epochs, not max_steps: it has no max_steps to "
                                                          r"raise.*raise its epochs to continue it")]
    for name, submission, why in refusals:
        with pytest.raises(ValueError, match=why):
            core.extend(name, submission)
        record = core.table.find(name)
        assert record.state == "completed" and record.reason.startswith("trained"), (name, record.reason)
        assert core.table.submission(record.id).job.epochs == {"capped": 1, "steps-only": None, "twice": 2}[name]

    both = core.extend("capped", _budget(capped, epochs=2, max_steps=8))   # max_steps raised beside it: it goes on
    assert both.state == "queued" and "max_steps 3 -> 8, epochs 1 -> 2" in both.reason


def test_a_raised_epochs_on_a_job_whose_checkpoint_was_deleted_is_refused(tmp_path, tiny_base, tiny_model_dirs):
    data = write_task_data(tmp_path / "data", "t")
    jobs = [job_dict("deleted", data, None, epochs=1, batch_size=5)]   # 2 steps
    core, (deleted,) = _ended(tmp_path, jobs, str(tiny_model_dirs["llama"]),
                              lambda spec: train_locally(spec, base=tiny_base, progress=False))
    shutil.rmtree(tmp_path / "out" / "deleted" / "checkpoint")
    with pytest.raises(ValueError, match="its checkpoint at step 2 is no longer in .*so it would train again from "
                                         "step 0, not on from step 2; put the checkpoint back and extend it again"):
        core.extend("deleted", _budget(deleted, epochs=2))
    assert core.table.submission(core.table.find("deleted").id).job.epochs == 1


def test_a_raised_job_waits_with_the_work_of_its_new_budget_not_none_left(tmp_path):
    """A job queued again by a raised budget is ordered by the policies (SJF, adaptive: shortest remaining work first;
    adaptive preempts a running job for one with far less left) by its remaining steps. Queued, it has trained its old
    budget to its end: reckoned against its old total it has none left (and would go before, even preempt, any job).
    Its remaining steps are the new budget's: 1 epoch of 10 rows in batches of 2 raised to 2 epochs trains 5 steps
    more (what a job given 2 epochs at once plans, less its 5), a max_steps 3 raised to 4 one step more."""
    data = write_task_data(tmp_path / "data", "t")
    core, (alone, by_steps) = _ended(tmp_path, [job_dict("alone", data, None, epochs=1, batch_size=2),
                                                job_dict("by-steps", data, 3, epochs=1, batch_size=2)])
    core.extend("alone", _budget(alone, epochs=2))
    core.extend("by-steps", _budget(by_steps, max_steps=4))
    trainer = dataclasses.replace(status("trainer-0"), base_model="smollm2-135m")
    views = {view.name: view for view in core.snapshot([trainer]).jobs}
    assert views["alone"].remaining_steps == planned_steps(_budget(alone, epochs=2).job, TRAIN_ROWS) - 5 == 5
    assert views["by-steps"].remaining_steps == 4 - 3


def _refused_at_its_data_end(state: Path) -> tuple[JobTable, SchedulerCore, Any, Any]:
    """The table, the scheduler core, the record and submission of the one job `aspen run` recorded in `state`, its
    raise to 2 epochs refused by extend first (it is at step 2, its data's end)."""
    from actors.service.table.job_table import read_jobs

    table = JobTable(state / "jobs.sqlite", busy_timeout=BUSY_S)
    core = SchedulerCore(table, FifoPolicy(), state)
    (record, submission), = read_jobs(state / "jobs.sqlite")
    with pytest.raises(ValueError, match=r"is at its data's end: .* the new total is step 2, the step it is at"):
        core.extend(record.id, _budget(submission, epochs=2))
    return table, core, record, submission


@pytest.mark.parametrize("streaming", [False, True])
def test_a_raise_to_epochs_its_data_already_ran_through_says_it_trains_nothing(tmp_path, tiny_base, tiny_model_dirs,
                                                                               capsys, streaming):
    """4 rows in batches of 4, 1.5 epochs: 2 steps, the second reading its second epoch's rows whole, so it has read
    its data twice, as a job given 2 epochs at once does (the reference: the same cursor and tokens). Raised to 2
    epochs it was said to continue from its checkpoint (`aspen run`'s plan, aspen extend) and ended at once at step 2;
    the plan now says it trains nothing more and why, extend refuses it, and a raise to 3 epochs continues. Streamed
    data alike (its cursor counts rows; the plan said the job continued)."""
    from tests.helpers.service import run_again

    base, data = tiny_model_dirs["llama"], write_task_data(tmp_path / "data", "t", rows=4)
    what = "rows" if streaming else "examples"

    def spec(epochs: float, folder: str = "out"):
        job = job_dict("half", data, None, epochs=epochs, lr_schedule="constant",
                       **({"streaming": True} if streaming else {}))
        return run_spec(str(base), tmp_path / folder, [job], step_tokens=1024)
    first = train_locally(spec(1.5), base=tiny_base, progress=False, record_in=tmp_path / "out/.aspen")
    reference = train_locally(spec(2, "reference"), base=tiny_base, progress=False)
    assert [s.steps for s in first] == [s.steps for s in reference] == [2]
    capsys.readouterr()

    again = run_again(spec(2), base=tiny_base)
    out = capsys.readouterr().out
    assert "it continues from its checkpoint" not in out, out
    assert ("half: epochs raised to 2, but it is at its data's end: its checkpoint at step 2 has read each of its 4 "
            f"training {what} 2 time(s)") in out, out
    assert "the new total is step 2, the step it is at, and it would train nothing more; give epochs above 2" in out
    assert [(s.state, s.steps) for s in again] == [("completed", 2)]

    table, core, record, submission = _refused_at_its_data_end(tmp_path / "out/.aspen")
    assert core.extend(record.id, _budget(submission, epochs=3)).state == "queued"
    table.close()


def _without_num_rows(folder) -> None:
    """The job's checkpoints as an aspen before streamed cursors saved `num_rows` wrote them (the key left out)."""
    import json

    for path in folder.glob("checkpoint*/state.json"):
        state = json.loads(path.read_text())
        assert state["cursor"].pop("num_rows") == 4, state["cursor"]   # what this aspen writes
        path.write_text(json.dumps(state))


def test_a_streamed_checkpoint_without_num_rows_is_judged_by_its_rows_counted_again_and_resumes(
        tmp_path, tiny_base, tiny_model_dirs, capsys):
    """A streamed job checkpointed by an older aspen, its cursor without `num_rows` (4 rows in batches of 4, 1.5
    epochs: 2 steps, at its data's end): a raise to 2 epochs was said to continue it (the check could not tell, and
    took it to train on) and it then ended at once; now its rows are counted again from its data, and the plan and
    extend say it trains nothing more, as for a checkpoint that has the count. Raised to 3 epochs it resumes from
    that checkpoint and trains to step 3, as a job given 3 epochs' continuation plans (`continued_steps`)."""
    from tests.helpers.service import run_again

    base, data = tiny_model_dirs["llama"], write_task_data(tmp_path / "data", "t", rows=4)

    def spec(epochs: float):
        job = job_dict("half", data, None, epochs=epochs, lr_schedule="constant", streaming=True)
        return run_spec(str(base), tmp_path / "out", [job], step_tokens=1024)
    first = train_locally(spec(1.5), base=tiny_base, progress=False, record_in=tmp_path / "out/.aspen")
    assert [s.steps for s in first] == [2]
    _without_num_rows(tmp_path / "out/half")
    capsys.readouterr()

    again = run_again(spec(2), base=tiny_base)
    out = capsys.readouterr().out
    assert "it continues from its checkpoint" not in out, out
    assert ("half: epochs raised to 2, but it is at its data's end: its checkpoint at step 2 has read each of its 4 "
            "training rows 2 time(s)") in out, out
    assert [(s.state, s.steps) for s in again] == [("completed", 2)]
    _refused_at_its_data_end(tmp_path / "out/.aspen")[0].close()

    resumed = run_again(spec(3), base=tiny_base)
    out = capsys.readouterr().out
    assert "it continues from its checkpoint" in out, out
    assert [(s.state, s.steps) for s in resumed] == [("completed", 3)]


def test_a_streamed_checkpoint_without_num_rows_whose_data_cannot_be_counted_says_so(tmp_path, monkeypatch):
    """The rows of a streamed job's data gone from its place cannot be counted again: the check says that it could
    not tell whether the raise trains anything, and why, rather than take it to train on or fail with a KeyError."""
    from actors.service.outputs.earlier_outputs import raise_trains_nothing_from
    from actors.spec.submission_changes import budget_raise

    data = write_task_data(tmp_path / "data", "t", rows=4)
    job = job_dict("half", data, None, epochs=1.5, lr_schedule="constant", streaming=True)
    submission, = run_spec("smollm2-135m", tmp_path / "out", [job]).submissions()
    raised = budget_raise(submission, _budget(submission, epochs=2))
    (tmp_path / "out/half").mkdir(parents=True)
    data.unlink()
    import actors.service.outputs.earlier_outputs as earlier

    # its checkpoint's cursor as an older aspen saved it at step 2: 2 epochs' rows read, at the end of the second
    cursor = {"epoch": 1, "position": 4, "examples_seen": 8, "seed": 0, "window": 1000, "first_row": 0}
    monkeypatch.setattr(earlier, "saved_cursor", lambda _folder: (2, cursor))
    reason = raise_trains_nothing_from(raised, tmp_path / "out/half")
    assert reason is not None and reason.startswith("of unknown length: its checkpoint at step 2, written by an older "
                                                    "aspen, does not record how many rows its streamed data has "
                                                    "(num_rows)"), reason
    assert str(data) in reason and "give epochs above 2" in reason, reason
    # a whole epoch more than it has read trains on whatever the count: not refused
    assert raise_trains_nothing_from(budget_raise(submission, _budget(submission, epochs=3)), tmp_path / "out/half") \
        is None
