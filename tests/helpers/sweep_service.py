"""A service's sweep in a process of its own, killed at a chosen point (tests/faults/test_sweep_crash_points.py).

`python -m tests.helpers.sweep_service STATE SWEEP_JSON STATUS_JSON [POINT N]` opens the state folder as the
scheduler does (`ServiceState`: its lock, its job table; `SchedulerCore.recover` as a restarted scheduler calls it;
the sweeps as `SweepBook` over `SchedulerJobs`), submits the sweep (as `aspen sweep FILE` does again after a
restart: the same sweep is the same sweep), then runs the scheduler's loop: a poll of the sweeps, then a planted
trainer's tick (the jobs the scheduler asked it to stop end cancelled, each queued job runs, each running one trains
2 steps and writes its train and eval losses as a trainer's reports do, resuming from its last step: what a
checkpoint gives a job after a restart; loss falls with the lr's distance to 1e-3), until the sweep is done; its
status is then written to STATUS_JSON.

POINT N: the process kills itself (SIGKILL: nothing flushed, nothing cleaned up) at that point of its Nth trial:
`suggested` (the searcher gave the trial's settings; nothing written since), `before-submit` (its job is about to
be entered in the job table), `after-submit` (its job was entered; the sweep has written nothing since), or
`after-save` (the sweep's state file was written after its job was entered); or at the first trial the sweep
stops: `stop-sent` (its job's cancel asked of the trainer, which dies with the service), `stop-landed` (the trainer
ended the job and its report is in the table: a report a dying scheduler spilled, applied at its next start) or
`stop-saved` (the sweep's state file written after the stop; the trainer's stop dies with the service)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from actors.service.scheduler.scheduler_core import SchedulerCore, StopRequest
from actors.service.sweeps.scheduler_jobs import SchedulerJobs
from actors.service.sweeps.sweep_book import SweepBook
from actors.service.sweeps.sweep_driver import SweepDriver
from actors.service.sweeps.sweep_run import SweepRun
from actors.service.table.state_dir import ServiceState
from actors.spec.sweep_spec import SweepSpec
from policies.fifo import FifoPolicy


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def crash_at(point: str, nth: int) -> None:
    """Patch the sweep's own steps so that the process dies at `point` of its `nth` trial (counted in this process)."""
    counts = {"suggested": 0, "submitted": 0}
    if point == "suggested":
        to_start = SweepRun.to_start

        def suggested(self):
            jobs = to_start(self)
            counts["suggested"] += len(jobs)
            if jobs and counts["suggested"] >= nth:
                die()
            return jobs
        SweepRun.to_start = suggested
        return
    submit = SchedulerJobs.submit

    def submitting(self, job, **kwargs):
        if point == "before-submit" and counts["submitted"] + 1 == nth:
            die()
        job_id = submit(self, job, **kwargs)
        counts["submitted"] += 1
        if point == "after-submit" and counts["submitted"] == nth:
            die()
        return job_id
    SchedulerJobs.submit = submitting
    if point.startswith("stop-"):
        cancel = SchedulerJobs.cancel

        def cancelled(self, job_id, reason):
            cancel(self, job_id, reason)
            if point == "stop-landed":   # the trainer stopped it at once, and its report is in the table
                TRAINER.stop_now(self.table)
            if point != "stop-saved":
                die()
            counts["stopped"] = 1
        SchedulerJobs.cancel = cancelled
        save = SweepDriver.save

        def saved(self):
            save(self)
            if counts.get("stopped"):
                die()
        SweepDriver.save = saved
    if point == "after-save":
        save = SweepDriver.save

        def saved(self):
            save(self)
            if counts["submitted"] >= nth:
                die()
        SweepDriver.save = saved


class PlantedTrainer:
    """The service's one trainer: the scheduler's stop requests (a cancel of a job it runs) are ended at its next
    tick, as a trainer ends a job at its next step boundary and reports it; they die with the process."""

    def __init__(self):
        self.stops: list[StopRequest] = []

    def stop(self, stop: StopRequest | None) -> None:
        if stop is not None:
            self.stops.append(stop)

    def stop_now(self, table) -> None:
        for stop in self.stops:
            table.set_state(stop.job, stop.kind, stop.reason, trainer=None)
        self.stops.clear()

    def tick(self, table) -> None:
        """Stops first; then queued jobs run, running ones train 2 steps (from where they were)."""
        self.stop_now(table)
        for record in table.all(("queued", "running")):
            train(table, record)


TRAINER = PlantedTrainer()


def train(table, record) -> None:
    spec = table.submission(record.id).job
    if record.state == "queued":
        table.set_state(record.id, "running", "training", trainer="planted")
    step = record.step + 2
    loss = 1.0 + abs(spec.lr - 1e-3) * 100 + 1.0 / step
    table.progress.add(record.id, {"step": step, "loss": loss})
    table.progress.add_eval(record.id, step, loss)
    table.update(record.id, step=step)
    if step >= spec.max_steps:
        table.set_state(record.id, "completed", "reached max_steps", trainer=None)


def main(state_dir: Path, sweep_file: Path, status_file: Path, point: str | None = None, nth: int = 0) -> None:
    if point is not None:
        crash_at(point, nth)
    state = ServiceState(state_dir)
    table = state.open_table(None)
    core = SchedulerCore(table, FifoPolicy(), state_dir)
    core.recover(resume=True)
    book = SweepBook(state_dir, SchedulerJobs(core, table, cancel=lambda job_id, reason: TRAINER.stop(
        core.cancel(job_id, reason)[1])))
    spec = SweepSpec.model_validate(json.loads(sweep_file.read_text()))
    book.add(spec)
    for _ in range(500):
        book.poll_all()
        if book.status(spec.name)["state"] != "running":
            break
        TRAINER.tick(table)
    TRAINER.stop_now(table)   # the stops of its last poll: the service runs on
    status_file.write_text(json.dumps(book.status(spec.name)))
    state.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), *(sys.argv[4:5]), *map(int, sys.argv[5:6]))
