"""The service's sweeps (actors/service/sweeps/sweep_book.py) over a fake job service whose trials train by a planted
loss curve: a sweep runs to its end with its results on disk; a sweep that fails (its state file cannot be
written: a folder where its file goes) is marked failed with the error while another goes on; a damaged state file is
reported for that sweep alone when the book is built again, the others carried on; a book built again on the
same folder (a restarted scheduler) ends a half-run sweep as an uninterrupted one."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from actors.service.sweeps.sweep_book import SweepBook
from actors.spec.sweep_spec import SweepSpec
from tests.helpers.sweep_jobs import JOB, FakeJobs, spec


def run(book: SweepBook, jobs: FakeJobs, rounds: int = 50) -> None:
    for _ in range(rounds):
        book.poll_all()
        jobs.advance()


def solo_trials(tmp_path) -> list[dict]:
    """The trials of sweep 'one' run whole in a book of its own (no failure, no restart): the reference."""
    jobs = FakeJobs()
    whole = SweepBook(tmp_path / "whole", jobs)
    whole.add(spec("one", tmp_path / "w"))
    run(whole, jobs)
    return whole.status("one")["trials"]


def test_a_sweep_runs_to_its_end_and_a_failing_one_stops_alone(tmp_path):
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state2", jobs)
    book.add(spec("good", tmp_path / "b"))
    book.add(spec("doomed", tmp_path / "b"))
    blocker = tmp_path / "state2" / "sweeps" / "doomed.json"
    blocker.unlink()
    blocker.mkdir()                        # its state cannot be written (a directory where its file goes)
    run(book, jobs)
    good, doomed = book.status("good"), book.status("doomed")
    assert good["state"] == "done" and good["best"] == "qa-t0" and good["error"] is None
    assert doomed["state"] == "failed" and "doomed.json" in doomed["error"]
    board = json.loads((tmp_path / "b" / "good" / "leaderboard.json").read_text())
    assert board == {"name": "good", "trials": good["trials"], "best": "qa-t0"}
    assert (tmp_path / "b" / "good" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_a_generation_objective_is_read_from_the_trials_scores_and_maximised(tmp_path):
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    scored = SweepSpec(**{**spec("scored", tmp_path).model_dump(mode="json"),
                          "objective": {"metric": "contains", "max_new_tokens": 8}})
    book.add(scored)
    run(book, jobs)
    status = book.status("scored")
    assert status["state"] == "done" and status["best"] == "qa-t0"
    by_name = {t["name"]: t for t in status["trials"]}
    for job in jobs.jobs.values():   # each trial's objective is its last score, each trial scored its generations
        assert job["spec"].eval_generate == scored.objective
        assert by_name[job["spec"].name]["objective"] == job["rows"][-1]["eval_score"]
    assert [t["name"] for t in status["trials"]] == ["qa-t0", "qa-t1", "qa-t2"]   # the highest score first


def test_a_damaged_state_file_is_that_sweeps_alone_and_a_rebuilt_book_carries_on(tmp_path):
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    book.add(spec("one", tmp_path))
    book.add(spec("two", tmp_path))
    run(book, jobs, rounds=2)                                     # halfway: trials running
    assert {s["state"] for s in book.all()} == {"running"}
    (tmp_path / "state" / "sweeps" / "two.json").write_text("{not json")
    (tmp_path / "state" / "sweeps" / "four.json").mkdir()      # not a file at all: the book started on none
    again = SweepBook(tmp_path / "state", jobs)                   # a restarted scheduler
    assert again.status("two")["state"] == "failed" and "two.json" in again.status("two")["error"]
    assert again.status("four")["state"] == "failed" and "IsADirectoryError" in again.status("four")["error"]
    run(again, jobs)
    assert again.status("one")["state"] == "done"
    assert again.status("one")["trials"] == solo_trials(tmp_path)
    with pytest.raises(KeyError, match="no sweep named 'three'"):
        again.status("three")


def test_the_report_names_every_trial_with_its_settings_and_steps_are_whole(tmp_path):
    """report.png's figure: a legend entry per trial with a curve (its name, its lr, how it ended), the stop
    marker explained, and only whole steps on the step axis (a few steps of a short sweep gave ticks like
    4.5); while a trial trains, its status shows its job's step, not the step of its last objective."""
    from actors.service.sweeps.sweep_book import report_figure

    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    book.add(spec("named", tmp_path / "b"))
    book.poll_all()
    jobs.advance()
    jobs.advance()
    book.poll_all()
    assert any(t["state"] == "running" and t["steps"] == 4 for t in book.status("named")["trials"])
    run(book, jobs)
    status, driver = book.status("named"), book.drivers["named"]
    figure = report_figure(driver.spec, status, driver.curves())
    axes = figure.axes[0]
    labels = [text.get_text() for text in axes.get_legend().get_texts()]
    drawn = [t for t in status["trials"] if driver.curves().get(t["name"])]
    assert len(drawn) >= 2
    for trial in drawn:
        (label,) = [label for label in labels if label.startswith(trial["name"] + ": ")]
        assert f"lr={trial['settings']['lr']:.3g}" in label
        if trial["name"] == status["best"]:
            assert label.endswith("(best)")
        elif trial["state"] == "stopped":
            assert label.endswith(f"(stopped at step {trial['steps']})")
    assert "x: where a trial was stopped" in labels
    figure.canvas.draw()
    assert all(float(tick).is_integer() for tick in axes.get_xticks())


def test_a_sweep_whose_trials_could_not_write_is_refused_at_once_and_an_ended_sweeps_name_is_free(tmp_path):
    """A sweep whose output_dir lies outside the service's output root was accepted, then failed at its first
    trial with its trials shown running; it is refused when added, with the service's reason. A failed or
    cancelled sweep's name may be taken by a sweep of other settings (the refusal told to delete the old one, which
    nothing can); one still running keeps its name."""
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.sweeps.scheduler_jobs import SchedulerJobs
    from actors.service.table.job_table import JobTable
    from policies.fifo import FifoPolicy

    root = tmp_path / "root"
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state", output_root=root)
    book = SweepBook(tmp_path / "state", SchedulerJobs(core, core.table, cancel=lambda job_id, reason: None))
    with pytest.raises(ValueError, match=r"sweep 'outside': its trials cannot write under output_dir .*outside: "
                                         r"output_dir .* is outside this service's output root"):
        book.add(spec("outside", tmp_path / "elsewhere"))
    assert "outside" not in book.drivers and core.table.all() == []
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state2", jobs)
    book.add(spec("busy", tmp_path / "b"))
    other = SweepSpec(**{**spec("busy", tmp_path / "b").model_dump(mode="json"), "max_concurrent": 1})
    with pytest.raises(ValueError, match=r"exists with other settings \(running\); .* or cancel it first"):
        book.add(other)
    book.cancel("busy")
    run(book, jobs, rounds=2)
    assert book.status("busy")["state"] == "cancelled"
    assert book.add(other)["state"] == "running" and book.drivers["busy"].spec == other


def test_a_trial_the_service_refuses_fails_alone_saying_why_and_the_sweep_goes_on(tmp_path):
    """A grid whose one setting makes a micro-batch no trainer can step (batch_size 4 x max_seq_len 1024 > the
    trainer's 512-token steps), over the service's real scheduler core: that trial fails with the service's
    reason, the other is submitted, and the sweep runs on (it failed whole, its never-started trials shown running
    for ever)."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.sweeps.scheduler_jobs import SchedulerJobs
    from actors.service.table.job_table import JobTable
    from policies.fifo import FifoPolicy

    (tmp_path / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    table = JobTable(tmp_path / "state/jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state",
                         trainers=[TrainerConfig(base_model="smollm2-135m", step_tokens=512)])
    book = SweepBook(tmp_path / "state", SchedulerJobs(core, table, cancel=lambda job_id, reason: None))
    job = JOB | {"data": str(tmp_path / "qa.jsonl")}
    book.add(SweepSpec(name="lengths", output_dir=str(tmp_path / "lengths"), job=job, search="grid",
                       max_concurrent=2, space={"max_seq_len": {"choice": [64, 1024]}}))
    book.poll_all()
    status = book.status("lengths")
    assert status["state"] == "running" and status["error"] is None, status
    trials = {trial["settings"]["max_seq_len"]: trial for trial in status["trials"]}
    assert trials[1024]["state"] == "failed", trials
    assert ("the service refused its job: job 'qa-t1': batch_size 4 * max_seq_len 1024 = 4096 tokens per "
            "micro-batch exceeds step_tokens 512") in trials[1024]["stopped_because"], trials[1024]
    assert trials[64]["state"] == "running"
    assert [record.name for record in table.all()] == [trials[64]["name"]]
    table.close()


def test_a_trial_extended_after_it_ended_is_followed_by_the_leaderboard_to_its_new_end(tmp_path):
    """A done sweep's trial continued to a larger max_steps through the service's own extend (what `aspen extend`,
    `POST /v1/jobs/{job}/extend` and `Client.raise_max_steps` call), over the real scheduler core and job table, its
    job's steps and evaluations written as a trainer's reports write them: its row kept the objective it first
    ended with, unmarked; it says `continued` while the job trains on, then takes the objective it ends with and
    ranks by it, on the status and in leaderboard.json; the searcher is not told again."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.sweeps.scheduler_jobs import SchedulerJobs
    from actors.service.table.job_table import JobTable
    from orchestrator.sweep import leaderboard_table
    from policies.fifo import FifoPolicy

    (tmp_path / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    table = JobTable(tmp_path / "state/jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state",
                         trainers=[TrainerConfig(base_model="smollm2-135m", step_tokens=512)])
    book = SweepBook(tmp_path / "state", SchedulerJobs(core, table, cancel=lambda job_id, reason: None))
    book.add(SweepSpec(name="ext", output_dir=str(tmp_path / "ext"), job=JOB | {"data": str(tmp_path / "qa.jsonl"),
                                                                              "max_seq_len": 64},
                       search="grid", max_concurrent=2, space={"lr": {"choice": [1e-3, 1e-2]}}))
    book.poll_all()
    ids = {record.name: record.id for record in table.all()}
    assert sorted(ids) == ["qa-t0", "qa-t1"]

    def train(job_id: str, evals: dict[int, float], end: str | None = "completed") -> None:
        table.set_state(job_id, "running", "training")
        for step, loss in evals.items():
            table.progress.add(job_id, {"step": step, "loss": loss})
            table.progress.add_eval(job_id, step, loss)
            table.update(job_id, step=step)
        if end is not None:
            table.set_state(job_id, end, "reached max_steps")
        book.poll_all()

    train(ids["qa-t0"], {4: 0.8, 8: 0.6})
    train(ids["qa-t1"], {4: 0.7, 8: 0.5})
    status = book.status("ext")
    assert status["state"] == "done" and status["best"] == "qa-t1"
    assert [(t["name"], t["objective"]) for t in status["trials"]] == [("qa-t1", 0.5), ("qa-t0", 0.6)]
    told = book.drivers["ext"].run.searcher.state()

    earlier = table.submission(ids["qa-t0"])   # Client.raise_max_steps's submission: only max_steps raised
    core.extend(ids["qa-t0"], earlier.model_copy(update={"job": earlier.job.model_copy(update={"max_steps": 16})}),
                "max_steps raised to 16")
    book.poll_all()
    trial = next(t for t in book.status("ext")["trials"] if t["name"] == "qa-t0")
    assert trial["state"] == "continued" and trial["continued_from"] == 8 and trial["objective"] == 0.6, trial
    assert book.status("ext")["best"] == "qa-t1"
    on_disk = json.loads((tmp_path / "ext" / "leaderboard.json").read_text())
    assert {t["name"]: t["state"] for t in on_disk["trials"]} == {"qa-t0": "continued", "qa-t1": "completed"}
    assert "continued from step 8" in leaderboard_table(book.status("ext"))

    train(ids["qa-t0"], {12: 0.45}, end=None)   # while it trains on: its objectives and its job's steps
    trial = next(t for t in book.status("ext")["trials"] if t["name"] == "qa-t0")
    assert (trial["state"], trial["objective"], trial["steps"]) == ("continued", 0.45, 12)
    train(ids["qa-t0"], {16: 0.3})
    status = book.status("ext")
    assert status["best"] == "qa-t0" and status["state"] == "done"
    assert [(t["name"], t["state"], t["objective"], t["steps"]) for t in status["trials"]] == [
        ("qa-t0", "completed", 0.3, 16), ("qa-t1", "completed", 0.5, 8)]
    assert status["trials"][0]["continued_from"] == 8 and status["trials"][0]["stopped_because"] is None
    on_disk = json.loads((tmp_path / "ext" / "leaderboard.json").read_text())
    assert on_disk == {"name": "ext", "trials": status["trials"], "best": "qa-t0"}
    assert book.drivers["ext"].run.searcher.state() == told
    again = SweepBook(tmp_path / "state", SchedulerJobs(core, table, cancel=lambda job_id, reason: None))
    assert again.status("ext")["trials"] == status["trials"]   # a restarted scheduler shows the same
    table.close()


def test_cancelling_a_sweep_cancels_the_trials_its_user_continued(tmp_path):
    """A done sweep's trials continued after they ended (`aspen extend`: the service's own extend, over the real
    scheduler core and job table): one the leaderboard already follows as `continued`, one extended just before the
    cancel (no poll between). Cancelling the sweep left both jobs training on; now both jobs end cancelled in the
    job table (the reference), and each row ends `cancelled`, still marked `continued_from`."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.sweeps.scheduler_jobs import SchedulerJobs
    from actors.service.table.job_table import JobTable
    from policies.fifo import FifoPolicy

    (tmp_path / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    table = JobTable(tmp_path / "state/jobs.sqlite")
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state",
                         trainers=[TrainerConfig(base_model="smollm2-135m", step_tokens=512)])
    book = SweepBook(tmp_path / "state", SchedulerJobs(core, table, cancel=lambda job_id, reason: core.cancel(
        job_id, reason)))
    book.add(SweepSpec(name="ext", output_dir=str(tmp_path / "ext"), job=JOB | {"data": str(tmp_path / "qa.jsonl"),
                                                                              "max_seq_len": 64},
                       search="grid", max_concurrent=2, space={"lr": {"choice": [1e-3, 1e-2]}}))
    book.poll_all()
    ids = {record.name: record.id for record in table.all()}
    for job_id in ids.values():
        table.set_state(job_id, "running", "training")
        table.progress.add(job_id, {"step": 8, "loss": 0.5})
        table.progress.add_eval(job_id, 8, 0.5)
        table.update(job_id, step=8)
        table.set_state(job_id, "completed", "reached max_steps")
    book.poll_all()
    assert book.status("ext")["state"] == "done"

    def extend(name: str) -> None:
        earlier = table.submission(ids[name])
        core.extend(ids[name], earlier.model_copy(update={"job": earlier.job.model_copy(update={"max_steps": 16})}),
                    "max_steps raised to 16")

    extend("qa-t0")
    book.poll_all()
    assert {t["name"]: t["state"] for t in book.status("ext")["trials"]}["qa-t0"] == "continued"
    extend("qa-t1")   # no poll: the sweep has not seen it continued yet
    assert {table.get(job_id).state for job_id in ids.values()} == {"queued"}
    book.cancel("ext")
    assert {name: table.get(job_id).state for name, job_id in ids.items()} == {"qa-t0": "cancelled",
                                                                             "qa-t1": "cancelled"}
    book.poll_all()
    status = book.status("ext")
    assert [(t["name"], t["state"], t["continued_from"]) for t in status["trials"]] == [
        ("qa-t0", "cancelled", 8), ("qa-t1", "cancelled", 8)], status["trials"]
    assert status["state"] == "cancelled"
    table.close()


def test_a_sweep_that_failed_with_trials_running_is_carried_on_when_submitted_again(tmp_path):
    """A sweep whose state could not be written (the disk full for a while) failed with its trials running; `aspen
    sweep FILE` run again sends the same sweep. Before, a running service (--address, --url) answered it failed
    again for ever (the same sweep is the same sweep; only another name started one), while its trials trained on
    unfollowed; now it is carried on from where it was, as `aspen sweep FILE`'s own service started again carries it on
    (the book built again on its state, which notes the failure, holds it failed until the sweep is submitted again).
    The reference: the same sweep run without a failure."""
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    book.add(spec("one", tmp_path))
    run(book, jobs, rounds=1)
    driver = book.drivers["one"]

    def disk_full():
        raise OSError(28, "No space left on device")

    driver.save = disk_full
    jobs.advance()
    book.poll_all()                          # a trial ended: the state is written, and cannot be
    failed = book.status("one")
    assert failed["state"] == "failed" and "No space left on device" in failed["error"]
    assert any(t["state"] == "running" for t in failed["trials"])
    # `aspen sweep FILE` again after the Ctrl-C that followed (its own service started again: the book built again
    # on the state written before the failure, the held trials resumed): carried on too
    shutil.copytree(tmp_path / "state", tmp_path / "state-again")
    jobs_again = copy.deepcopy(jobs)
    again = SweepBook(tmp_path / "state-again", jobs_again)
    assert again.status("one")["state"] == "failed"          # its failure noted in its state: held failed
    assert "No space left on device" in again.status("one")["error"]
    assert again.add(spec("one", tmp_path))["state"] == "running"   # as `aspen sweep FILE` again submits it
    run(again, jobs_again)
    del driver.save                          # space again
    assert book.add(spec("one", tmp_path))["state"] == "running"
    run(book, jobs)
    assert book.status("one")["state"] == "done" and book.status("one")["error"] is None
    assert book.status("one")["trials"] == solo_trials(tmp_path) == again.status("one")["trials"]
    assert again.status("one")["state"] == "done"


def test_a_trial_whose_job_id_cannot_be_written_is_not_entered_until_it_can(tmp_path):
    """The disk full when a sweep starts its first trials: before, their jobs were entered and only then the state
    file (which job each trial is) failed to be written, so the jobs trained on while a restarted scheduler, not
    knowing them, started the same trials again. Now a trial's job id is written before its job is entered: no job
    is entered while it cannot be, the trials wait pending in the failed sweep, and once there is room again the
    same sweep carries on with one job per trial, ending as the sweep run with room throughout (the reference)."""
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    book.add(spec("one", tmp_path))

    def disk_full():
        raise OSError(28, "No space left on device")

    book.drivers["one"].save = disk_full
    book.poll_all()
    failed = book.status("one")
    assert failed["state"] == "failed" and "No space left on device" in failed["error"]
    assert jobs.jobs == {}                                         # nothing entered that the sweep could not note
    assert {t["state"] for t in failed["trials"]} == {"pending"}
    del book.drivers["one"].save                                   # room again: the same sweep submitted again
    assert book.add(spec("one", tmp_path))["state"] == "running"
    run(book, jobs)
    assert book.status("one")["state"] == "done"
    assert book.status("one")["trials"] == solo_trials(tmp_path)
    assert sorted(job["spec"].name for job in jobs.jobs.values()) == ["qa-t0", "qa-t1", "qa-t2"]


def test_a_trial_stopped_while_its_state_cannot_be_written_still_has_its_job_cancelled(tmp_path):
    """A trial's stop is written to the sweep's state before its job is cancelled (a restart then cancels a job
    whose cancel was lost); with the disk full at that moment the sweep fails, saying why, and the stopped trial's job
    is cancelled all the same in the service (the fake's job table), not left training to its end."""
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    book.add(SweepSpec(**{**spec("one", tmp_path).model_dump(mode="json"),
                          "stopping": {"asha": {"grace_steps": 2, "reduction": 2}}}))
    book.poll_all()                    # qa-t0 and qa-t1 start
    jobs.advance()                     # both report step 2: qa-t1 (lr 3e-3) is worse than qa-t0 at the first rung

    def disk_full():
        raise OSError(28, "No space left on device")

    book.drivers["one"].save = disk_full
    book.poll_all()
    assert book.status("one")["state"] == "failed" and "No space left on device" in book.status("one")["error"]
    assert {job["spec"].name: job["state"] for job in jobs.jobs.values()} == {"qa-t0": "running",
                                                                            "qa-t1": "cancelled"}
