"""`aspen sweep FILE --url` (or --address) of a sweep that failed with its trials running (its state could not be
written: the disk full for a while), run again: before, it said 'failed' again for ever, naming no way on; now the
failure says that the same command carries it on once the cause is fixed, and it does. The real CLI (`main`) over a
running service's sweeps as the scheduler holds them (actors/service/sweeps/sweep_book.py over fake trials); the
reference: the same sweep run without a failure."""

from __future__ import annotations

import json

import yaml

from actors.service.sweeps.sweep_book import SweepBook
from orchestrator.cli import main, sweep_commands
from tests.helpers.sweep_jobs import FakeJobs, spec


class Service:
    """A running service's sweeps: each look at a sweep is a tick of the scheduler (its sweeps polled, the trials
    two steps on)."""

    def __init__(self, book: SweepBook, jobs: FakeJobs):
        self.book, self.jobs = book, jobs

    def sweep(self, sweep_spec, check_rows=True):
        return self.book.add(sweep_spec)

    def sweep_status(self, name):
        self.book.poll_all()
        self.jobs.advance()
        return self.book.status(name)


def test_a_failed_sweep_run_again_says_how_and_is_carried_on(tmp_path, monkeypatch, capsys):
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n"
                                               for i in range(12)))
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(spec("one", tmp_path / "out").model_dump(mode="json")))
    jobs = FakeJobs()
    book = SweepBook(tmp_path / "state", jobs)
    monkeypatch.setattr(sweep_commands, "connect_service", lambda _: Service(book, jobs))
    monkeypatch.chdir(tmp_path)
    real_add = book.add

    def add_then_fill_the_disk(sweep_spec):
        status = real_add(sweep_spec)
        driver = book.drivers["one"]
        save = driver.save

        def disk_full():   # once the first trials' ids are written and their jobs entered
            if not jobs.jobs:
                return save()
            raise OSError(28, "No space left on device")
        driver.save = disk_full
        return status

    monkeypatch.setattr(book, "add", add_then_fill_the_disk)
    command = ["sweep", "--url", "http://service", "--poll", "0", str(sweep_file)]
    assert main(command) == 1
    said = capsys.readouterr().err
    assert "aspen: sweep one failed: OSError: [Errno 28] No space left on device" in said
    assert f"once that is fixed, `aspen sweep {sweep_file}` again carries the sweep on from where it was" in said
    assert any(t["state"] == "running" for t in book.status("one")["trials"])
    del book.drivers["one"].save      # space again
    monkeypatch.setattr(book, "add", real_add)
    assert main([*command, "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()   # each trial's line as it goes, then the leaderboard
    board = json.loads("\n".join(lines[lines.index("{"):]))
    whole_jobs = FakeJobs()
    whole = SweepBook(tmp_path / "whole", whole_jobs)
    whole.add(spec("one", tmp_path / "w"))
    for _ in range(50):
        whole.poll_all()
        whole_jobs.advance()
    assert board == {"trials": whole.status("one")["trials"], "best": "qa-t0"}
