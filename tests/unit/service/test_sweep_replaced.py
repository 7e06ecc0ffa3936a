"""A cancelled or failed sweep replaced by one of the same name and other settings (docs/sweeps.md, "Surviving"), over
the service's own scheduler core, job table and sweep book, with a planted trainer that writes each job's metrics to
its folder. Before, the replacement was accepted and each of its trials failed at once: the old trials' ended jobs
had written to the same folders ("wrote its results to ..., which this job would overwrite"). Now the old sweep's
results move to `<output_dir>/replaced-1/` (its trial folders, report and leaderboard; its jobs' output_dir with them)
and the new sweep ends as the same sweep run alone on a service of its own (the reference). A service started again
on a failed sweep's state (`aspen sweep FILE` again, its own service) holds it failed, so that a file of other
settings replaces it too, cancelling the trials that were held paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.service.table.job_table import JobTable
from actors.spec.sweep_spec import SweepSpec
from orchestrator.sweep import read_results
from policies.fifo import FifoPolicy
from tests.helpers.sweep_jobs import JOB
from tests.helpers.sweep_service import train


class Service:
    """A scheduler core, its job table and its sweeps on `state`; a tick trains every queued or running job two steps
    (tests/helpers/sweep_service.py's planted trainer) and appends its losses to its folder's metrics.jsonl."""

    def __init__(self, state: Path):
        self.table = JobTable(state / "jobs.sqlite")
        self.core = SchedulerCore(self.table, FifoPolicy(), state)
        self.book = SweepBook(state, SchedulerJobs(self.core, self.table, cancel=self.cancel))

    def cancel(self, job_id: str, reason: str) -> None:
        record, stop = self.core.cancel(job_id, reason)
        if stop is not None:   # the trainer ends it at once
            self.table.set_state(job_id, "cancelled", reason, trainer=None)

    def tick(self) -> None:
        self.book.poll_all()
        for record in self.table.all(("queued", "running")):
            train(self.table, record)
            folder = Path(record.output_dir)
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / "metrics.jsonl").open("a") as metrics:
                metrics.write(json.dumps(self.table.progress.of_job(record.id)[-1]) + "\n")

    def run(self, name: str) -> dict:
        for _ in range(50):
            self.tick()
            if self.book.status(name)["state"] != "running":
                break
        return self.book.status(name)


def sweep(folder: Path, **fields) -> SweepSpec:
    (folder / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    job = JOB | {"data": str(folder / "qa.jsonl")}
    return SweepSpec(**{"name": "lr", "output_dir": str(folder / "out"), "job": job, "search": "grid",
                        "max_concurrent": 2, "space": {"lr": {"choice": [1e-3, 3e-3]}}, **fields})


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def run_alone(folder: Path, spec: SweepSpec) -> dict:
    service = Service(folder / "state")
    service.book.add(spec.model_copy(update={"output_dir": str(folder / "out")}))
    return service.run(spec.name)


def test_a_cancelled_sweep_is_replaced_its_results_moved_aside_and_the_new_one_ends_as_if_alone(tmp_path):
    service = Service(tmp_path / "state")
    old = sweep(tmp_path, job=JOB | {"data": str(tmp_path / "qa.jsonl"), "max_steps": 20})
    service.book.add(old)
    for _ in range(3):
        service.tick()
    service.book.cancel("lr")
    service.tick()
    cancelled = service.book.status("lr")
    assert cancelled["state"] == "cancelled" and {t["state"] for t in cancelled["trials"]} == {"cancelled"}
    old_files = {name: folder_files(tmp_path / "out" / name) for name in ("qa-t0", "qa-t1")}
    old_jobs = {r.name: r.id for r in service.table.all()}
    assert all(old_files.values())

    new = sweep(tmp_path, space={"lr": {"choice": [2e-3, 5e-4]}})
    added = service.book.add(new)
    assert added["replaced"] == {"name": "lr", "state": "cancelled", "folder": str(tmp_path / "out" / "replaced-1"),
                                 "jobs": old_jobs, "cancelled": []}
    # its status says so, from its state file too (a service started again on it): before, only `add`'s answer did
    assert service.book.status("lr")["replaced"] == added["replaced"]
    assert Service(tmp_path / "state").book.status("lr")["replaced"] == added["replaced"]
    status = service.run("lr")
    assert status["replaced"] == added["replaced"]
    reference = run_alone(tmp_path / "alone", new)
    assert reference["replaced"] is None
    assert status["state"] == "done" and status["trials"] == reference["trials"] and status["best"] == "qa-t1"
    assert {t["state"] for t in status["trials"]} == {"completed"}
    assert read_results(tmp_path / "out") == {"name": "lr", "trials": status["trials"], "best": "qa-t1"}

    moved = tmp_path / "out" / "replaced-1"
    for name, files in old_files.items():   # the old trials' folders as they were, their jobs following them
        assert folder_files(moved / name) == files
        assert service.table.get(old_jobs[name]).output_dir == str(moved / name)
        assert service.table.submission(old_jobs[name]).output_dir == moved / name
    kept = read_results(moved)
    assert kept["trials"] == cancelled["trials"] and kept["replaced"]["state"] == "cancelled"
    assert (moved / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "state" / "sweeps" / "replaced" / "lr-1.json").is_file()
    for name in ("qa-t0", "qa-t1"):   # the new trials' folders hold only their own jobs' metrics
        (job,) = [r for r in service.table.all() if r.output_dir == str(tmp_path / "out" / name)]
        metrics = (tmp_path / "out" / name / "metrics.jsonl").read_text()
        steps = [json.loads(line)["step"] for line in metrics.splitlines()]
        assert steps == [2, 4, 6, 8] and job.id not in old_jobs.values()

    again = sweep(tmp_path, space={"lr": {"choice": [1e-2]}})   # a done sweep keeps its name
    with pytest.raises(ValueError, match=r"sweep 'lr' exists with other settings \(done\)"):
        service.book.add(again)


def test_a_failed_sweep_held_failed_by_a_restart_is_replaced_and_its_held_trial_cancelled(tmp_path):
    """`aspen sweep FILE` (its own service) whose searcher raised: the trial that trained on is held paused as that
    service stops. Before, the service started again by `aspen sweep` of another file carried the failed sweep on as
    running (refusing the new one until it was cancelled, which no running service could do) and resumed its held
    trial; now the failure is in its state: held failed, the new file replaces it, its held trial is cancelled (its
    folder moved: `aspen resume` continues it there) and the same file again would have carried it on."""
    service = Service(tmp_path / "state")
    old = sweep(tmp_path, search="tests.helpers.searchers:FailsAtFirstResult", trials=2, max_concurrent=1,
                job=JOB | {"data": str(tmp_path / "qa.jsonl"), "max_steps": 20})
    service.book.add(old)
    for _ in range(3):
        service.tick()
    failed = service.book.status("lr")
    assert failed["state"] == "failed" and "planted searcher failure" in failed["error"]
    (trial,) = service.table.all()
    service.table.set_state(trial.id, "paused", "held: its run stopped", trainer=None)   # as its service stops
    restarted = Service(tmp_path / "state")
    assert restarted.book.status("lr")["state"] == "failed"
    assert "before this service started" in restarted.book.status("lr")["error"]

    new = sweep(tmp_path, space={"lr": {"choice": [2e-3, 5e-4]}})
    replaced = restarted.book.add(new)["replaced"]
    assert replaced["state"] == "failed" and replaced["cancelled"] == [trial.id]
    record = restarted.table.get(trial.id)
    assert record.state == "cancelled" and record.output_dir == str(tmp_path / "out" / "replaced-1" / "qa-t0")
    assert f"aspen resume {trial.id} continues it" in record.reason
    status = restarted.run("lr")
    assert status["state"] == "done" and status["trials"] == run_alone(tmp_path / "alone", new)["trials"]
    assert restarted.table.get(trial.id).state == "cancelled"   # not resumed, not followed by the new sweep
    assert restarted.core.resume(trial.id).state == "queued"     # its user may still continue it, in its new folder


def test_a_replacement_cut_short_is_finished_by_the_next_into_the_same_folder(tmp_path, monkeypatch):
    """The service dies while it moves the old sweep's folders (after the first trial's): submitted again to the
    service started again, the replacement finishes into the same `replaced-1` (not a second folder splitting the old
    sweep), every old job's output_dir its folder there, and the new sweep runs to its end."""
    from actors.service.sweeps import replaced_sweeps

    service = Service(tmp_path / "state")
    service.book.add(sweep(tmp_path, job=JOB | {"data": str(tmp_path / "qa.jsonl"), "max_steps": 20}))
    for _ in range(2):
        service.tick()
    service.book.cancel("lr")
    service.tick()
    old_files = {name: folder_files(tmp_path / "out" / name) for name in ("qa-t0", "qa-t1")}
    old_jobs = {r.name: r.id for r in service.table.all()}
    moves = []

    def dies_at_the_second(source, target):
        if moves:
            raise SystemExit("killed")
        moves.append(target)
        replace_durably(source, target)

    replace_durably = replaced_sweeps.replace_durably
    monkeypatch.setattr(replaced_sweeps, "replace_durably", dies_at_the_second)
    new = sweep(tmp_path, space={"lr": {"choice": [2e-3, 5e-4]}})
    with pytest.raises(SystemExit):
        service.book.add(new)
    assert len(moves) == 1 and (tmp_path / "out" / "qa-t1").is_dir()   # cut short: one folder moved
    monkeypatch.undo()
    restarted = Service(tmp_path / "state")
    assert restarted.book.status("lr")["state"] == "cancelled"
    assert restarted.book.add(new)["replaced"]["folder"] == str(tmp_path / "out" / "replaced-1")
    moved = tmp_path / "out" / "replaced-1"
    for name, files in old_files.items():
        assert folder_files(moved / name) == files
        assert restarted.table.get(old_jobs[name]).output_dir == str(moved / name)
    assert not (tmp_path / "out" / "replaced-2").exists()
    assert restarted.run("lr")["trials"] == run_alone(tmp_path / "alone", new)["trials"]
