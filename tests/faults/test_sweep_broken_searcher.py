"""A sweep whose plug-in searcher breaks, and the service started again on the same state folder: the scheduler's own
job table, recovery and sweep book (as tests/helpers/sweep_service.py runs them), its planted trainer. Before, a
searcher whose `restore` raised anything but ValueError/KeyError (a RuntimeError of its own, an ImportError: its
module gone) at the service's start stopped the whole service from starting; and a cancelled sweep whose searcher's
`save` raised was saved with no searcher state at all, so a restart could not carry it on. Now that sweep alone is
failed (its state file kept as it was, its error naming the searcher, the exception and what to do) while the service
and the other sweeps start, and the same sweep file submitted again (the searcher fixed) carries it on; a cancelled
sweep keeps its searcher's last good state and stays cancelled, readable, after a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.service.table.state_dir import ServiceState
from actors.spec.sweep_spec import SweepSpec
from policies.fifo import FifoPolicy
from tests.helpers import searchers
from tests.helpers.sweep_service import TRAINER

JOB = {"name": "qa", "format": {"type": "alpaca"}, "max_steps": 8, "eval_split": 4, "eval_every": 2, "lr": 1e-3}


class Service:
    """The service's state folder opened as a (re)started scheduler opens it, its sweeps built from it."""

    def __init__(self, state_dir: Path):
        self.state = ServiceState(state_dir)
        self.table = self.state.open_table(None)
        core = SchedulerCore(self.table, FifoPolicy(), state_dir)
        core.recover(resume=True)
        self.book = SweepBook(state_dir, SchedulerJobs(core, self.table, cancel=lambda job_id, reason: TRAINER.stop(
            core.cancel(job_id, reason)[1])))

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self.book.poll_all()
            TRAINER.tick(self.table)
        TRAINER.stop_now(self.table)

    def close(self) -> None:   # as the service's process ends: its table closed, its lock (a flock) gone with it
        self.state.close()
        self.state.lock.close()


def sweep(folder: Path, name: str, search: str) -> SweepSpec:
    (folder / "qa.jsonl").write_text('{"instruction": "q", "output": "a"}\n' * 8)
    return SweepSpec.model_validate({"name": name, "output_dir": str(folder / name), "seed": 3, "trials": 3,
                                     "max_concurrent": 1, "job": {**JOB, "data": str(folder / "qa.jsonl")},
                                     "search": search, "space": {"lr": {"choice": [1e-3, 3e-3, 1e-2]}}})


@pytest.mark.parametrize("broken", [RuntimeError, ImportError])
def test_a_searcher_that_cannot_be_restored_fails_its_sweep_alone_and_the_same_file_carries_it_on(
        tmp_path, monkeypatch, broken):
    monkeypatch.setattr(searchers.RestoreFails, "broken", broken)
    good, bad = sweep(tmp_path, "good", "grid"), sweep(tmp_path, "bad", "tests.helpers.searchers:RestoreFails")
    service = Service(tmp_path / "state")
    service.book.add(good)
    service.book.add(bad)
    service.run(3)   # bad's first trial trains on
    assert service.book.status("bad")["state"] == "running"
    service.close()
    kept = (tmp_path / "state" / "sweeps" / "bad.json").read_bytes()

    service = Service(tmp_path / "state")   # before: the RuntimeError / ImportError out of SweepBook.__init__
    status = service.book.status("bad")
    assert status["state"] == "failed"
    assert ("its searcher tests.helpers.searchers:RestoreFails cannot be restored from its saved state: its restore "
            f"raised {broken.__name__}: planted restore failure") in status["error"]
    assert "fix the searcher (or install its module), then submit the same sweep file again" in status["error"]
    service.run(40)
    assert service.book.status("good")["state"] == "done"
    assert service.book.status("bad")["state"] == "failed"
    assert (tmp_path / "state" / "sweeps" / "bad.json").read_bytes() == kept   # its state kept as it was

    with pytest.raises(ValueError, match="planted restore failure"):   # still broken: submitting it says so
        service.book.add(bad)
    monkeypatch.setattr(searchers.RestoreFails, "broken", None)   # the searcher fixed: the same file carries it on
    assert service.book.add(bad)["state"] == "running"
    service.run(40)
    done = service.book.status("bad")
    assert done["state"] == "done" and [t["state"] for t in done["trials"]] == ["completed"] * 3
    qa_t0 = [r for r in service.table.all() if r.name == "qa-t0" and "bad" in r.output_dir]
    assert len(qa_t0) == 1   # its first trial's job followed again, not entered a second time
    service.close()


def test_a_searcher_whose_constructor_raises_at_a_restart_fails_its_sweep_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(searchers.RestoreFails, "broken", None)
    bad = sweep(tmp_path, "bad", "tests.helpers.searchers:RestoreFails")
    service = Service(tmp_path / "state")
    service.book.add(sweep(tmp_path, "good", "grid"))
    service.book.add(bad)
    service.run(3)
    service.close()
    monkeypatch.setattr(searchers.RestoreFails, "built", False)
    service = Service(tmp_path / "state")   # before: the RuntimeError out of SweepBook.__init__
    status = service.book.status("bad")
    assert status["state"] == "failed" and "cannot be built: it raised RuntimeError: planted constructor failure" in (
        status["error"])
    service.run(40)
    assert service.book.status("good")["state"] == "done"
    monkeypatch.setattr(searchers.RestoreFails, "built", True)
    assert service.book.add(bad)["state"] == "running"
    service.close()


def test_a_cancelled_sweep_whose_searcher_cannot_save_keeps_its_last_state_and_stays_cancelled(tmp_path,
                                                                                                monkeypatch):
    spec = sweep(tmp_path, "quiet", "tests.helpers.searchers:StateFails")
    service = Service(tmp_path / "state")
    service.book.add(spec)
    service.run(3)
    path = tmp_path / "state" / "sweeps" / "quiet.json"
    good = json.loads(path.read_text())["driver"]["run"]["searcher"]
    assert good is not None
    monkeypatch.setattr(searchers.StateFails, "broken", True)   # its save raises from now on, its words too
    service.book.cancel("quiet")
    service.run(5)
    ended = service.book.status("quiet")
    assert ended["state"] == "cancelled" and ended["error"] is None
    assert json.loads(path.read_text())["driver"]["run"]["searcher"] == good   # before: None
    service.close()

    service = Service(tmp_path / "state")
    again = service.book.status("quiet")
    assert again["state"] == "cancelled" and again["error"] is None
    assert again["trials"] == ended["trials"] and again["best"] == ended["best"]
    service.run(2)
    assert json.loads(path.read_text())["driver"]["run"]["searcher"] == good
    service.close()


def test_a_cancelled_sweep_still_says_what_its_searcher_raised_after_a_restart(tmp_path):
    """`searcher_errors` (what a cancelled sweep's quieted searcher raised: `aspen sweep status` says it) was kept in
    memory only: the service started again showed none, its user lost the reason. Now it is in the sweep's state."""
    service = Service(tmp_path / "state")
    service.book.add(sweep(tmp_path, "loud", "tests.helpers.searchers:FailsAtEveryWord"))
    service.run(3)   # its searcher raises at the first result: the sweep fails, its trial trains on
    assert service.book.status("loud")["state"] == "failed"
    service.book.cancel("loud")
    service.run(3)   # the trial's end told to the searcher, which raises again (quieted: the sweep ends cancelled)
    ended = service.book.status("loud")
    assert ended["state"] == "cancelled" and ended["searcher_errors"]["count"] >= 1
    assert any("planted searcher failure at qa-t0's end" in e for e in ended["searcher_errors"]["last"])
    service.close()

    service = Service(tmp_path / "state")   # before: searcher_errors None
    again = service.book.status("loud")
    assert again["state"] == "cancelled" and again["error"] is None
    assert again["searcher_errors"] == ended["searcher_errors"]
    service.close()


def _ran_a_trial_then_stopped(tmp_path, monkeypatch) -> str:
    """A sweep 'lr' whose searcher's restore will raise, run until its first trial's job ('qa-t0') is entered, the
    service then closed: that job's id."""
    monkeypatch.setattr(searchers.RestoreFails, "broken", RuntimeError)
    service = Service(tmp_path / "state")
    service.book.add(sweep(tmp_path, "lr", "tests.helpers.searchers:RestoreFails"))
    service.run(3)
    (job,) = [r.id for r in service.table.all() if r.name == "qa-t0"]
    service.close()
    return job


def test_a_sweep_held_failed_as_its_searcher_cannot_be_restored_is_replaced_by_one_of_other_settings(tmp_path,
                                                                                                     monkeypatch):
    """Before, a sweep of the same name and other settings was refused (the old state restored under the new file:
    "it ran with search ..., the file now says grid; start it under another name", or the same restore error), and
    `aspen sweep cancel` knew no such sweep: its user had to find and move `<state_dir>/sweeps/NAME.json` by hand.
    Now the held sweep shows its trials, and a file of other settings replaces it as it does a failed sweep: its
    results move to `<output_dir>/replaced-1/`, its held trial's job is cancelled, and the new sweep ends as the
    same sweep run alone on a service of its own (the reference)."""
    old_job = _ran_a_trial_then_stopped(tmp_path, monkeypatch)

    service = Service(tmp_path / "state")
    held = service.book.status("lr")
    assert held["state"] == "failed" and "planted restore failure" in held["error"]
    assert f"or submit a sweep 'lr' of other settings to replace it (its results move to {tmp_path / 'lr'}" in (
        held["error"])
    assert [t["name"] for t in held["trials"]] == ["qa-t0"]   # before: none shown
    new = sweep(tmp_path, "lr", "grid")
    replaced = service.book.add(new)["replaced"]   # before: SweepStateError
    assert replaced["state"] == "failed" and replaced["folder"] == str(tmp_path / "lr" / "replaced-1")
    assert replaced["jobs"] == {"qa-t0": old_job} and service.table.get(old_job).state == "cancelled"
    assert service.table.get(old_job).output_dir == str(tmp_path / "lr" / "replaced-1" / "qa-t0")
    assert (tmp_path / "state" / "sweeps" / "replaced" / "lr-1.json").exists()   # the old state kept aside
    service.run(40)
    done = service.book.status("lr")
    service.close()

    (tmp_path / "alone").mkdir()
    alone = Service(tmp_path / "alone" / "state")   # the reference: the same file on a service of its own
    alone.book.add(sweep(tmp_path / "alone", "lr", "grid"))
    alone.run(40)
    reference = alone.book.status("lr")
    alone.close()
    assert done["state"] == reference["state"] == "done"
    assert done["trials"] == reference["trials"] and done["best"] == reference["best"]


def test_a_sweep_held_failed_as_its_searcher_cannot_be_restored_is_cancelled(tmp_path, monkeypatch):
    """Before, `aspen sweep cancel` of such a sweep answered "no sweep named ...": it stayed failed, its held trial's
    job resumed by the restarted service trained on. Now the cancel ends it `cancelled` (its job cancelled, its state
    file cancelled, its searcher's saved state as it was), and a service started again holds it cancelled, saying
    what its searcher raised as it was restored."""
    job = _ran_a_trial_then_stopped(tmp_path, monkeypatch)
    path = tmp_path / "state" / "sweeps" / "lr.json"
    saved = json.loads(path.read_text())["driver"]["run"]["searcher"]

    service = Service(tmp_path / "state")
    assert service.book.status("lr")["state"] == "failed"
    answer = service.book.cancel("lr")   # before: KeyError "no sweep named 'lr'"
    assert "planted restore failure" in answer["failed_before"]
    service.run(3)
    ended = service.book.status("lr")
    assert ended["state"] == "cancelled" and [t["state"] for t in ended["trials"]] == ["cancelled"]
    assert service.table.get(job).state == "cancelled"
    stored = json.loads(path.read_text())["driver"]
    assert stored["cancelled"] and stored["run"]["searcher"] == saved
    service.close()

    service = Service(tmp_path / "state")
    again = service.book.status("lr")
    assert again["state"] == "cancelled" and again["error"] is None
    assert any("restore raised RuntimeError: planted restore failure" in e for e in again["searcher_errors"]["last"])
    service.close()


def _cancelled_then_stopped(tmp_path, monkeypatch) -> dict:
    """A sweep 'lr' of a searcher that restores (for now), cancelled after its first rounds, the service then
    closed: the sweep's status as it was cancelled."""
    monkeypatch.setattr(searchers.RestoreFails, "broken", None)
    service = Service(tmp_path / "state")
    service.book.add(sweep(tmp_path, "lr", "tests.helpers.searchers:RestoreFails"))
    service.run(3)
    service.book.cancel("lr")
    service.run(3)
    ended = service.book.status("lr")
    service.close()
    return ended


def test_a_cancelled_sweep_whose_searcher_cannot_be_built_at_a_restart_stays_cancelled(tmp_path, monkeypatch):
    """A cancelled sweep whose plug-in searcher can no longer be built (its module removed after the cancel): before,
    the service started again held it `failed`, telling its user to fix a searcher the sweep no longer needs; now it
    stays cancelled, its trials shown, the searcher's error in its `searcher_errors`."""
    ended = _cancelled_then_stopped(tmp_path, monkeypatch)
    assert ended["state"] == "cancelled"

    monkeypatch.setattr(searchers.RestoreFails, "built", False)
    service = Service(tmp_path / "state")
    again = service.book.status("lr")   # before: failed, "cannot be built ... fix the searcher"
    assert again["state"] == "cancelled" and again["error"] is None and again["trials"] == ended["trials"]
    assert any("cannot be built: it raised RuntimeError: planted constructor failure" in e
               for e in again["searcher_errors"]["last"])
    service.close()


def test_a_cancelled_sweep_whose_searcher_cannot_be_restored_keeps_its_searchers_saved_state(tmp_path, monkeypatch):
    """A cancelled sweep restored at a restart while its searcher's `restore` raises (quieted, as a cancelled sweep's
    searcher is): before, the next write of its state (here `aspen sweep cancel` again) saved the unrestored
    searcher's fresh state over the one it had saved; now the saved one is kept as it was."""
    _cancelled_then_stopped(tmp_path, monkeypatch)
    path = tmp_path / "state" / "sweeps" / "lr.json"
    saved = json.loads(path.read_text())["driver"]["run"]["searcher"]

    monkeypatch.setattr(searchers.RestoreFails, "broken", RuntimeError)
    service = Service(tmp_path / "state")
    assert service.book.status("lr")["state"] == "cancelled"
    service.book.cancel("lr")   # its state written again
    assert json.loads(path.read_text())["driver"]["run"]["searcher"] == saved
    service.close()
