"""`aspen sweep cancel NAME --from OUTPUT_DIR`: a sweep whose service is not running cancelled in the folder its
service kept its state in, with no service started. An `aspen sweep FILE` of its own service that was interrupted
(Ctrl-C) leaves its sweep running in `<output_dir>/.aspen` (its trials' jobs held paused there): a file of the same
name and other settings is refused against it ("cancel it first"), and `aspen sweep cancel NAME` finds no service to
ask. Here the sweep is cancelled as its service would cancel it (`SweepBook.cancel` over that folder's job table):
its held trials' jobs cancelled (`aspen resume JOB` still continues one from its checkpoint), its trials ended
`cancelled`, its state and leaderboard written; the next `aspen sweep FILE` of other settings replaces it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REASON = "cancelled by the user (aspen sweep cancel --from: its service was not running)"


def cancel_in_folder(state_dir: Path, name: str) -> dict[str, Any]:
    """The sweep `name` of the state folder `state_dir` (a run's `.aspen`) cancelled there; its status afterwards,
    with the cancel's `problems` (`SweepBook.cancel`). Refused (ValueError) while a service holds that folder."""
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.sweeps.scheduler_jobs import SchedulerJobs
    from actors.service.sweeps.sweep_book import SweepBook
    from actors.service.table.job_table import JobTable
    from actors.service.table.state_dir import live_holder
    from policies.fifo import FifoPolicy

    if not (state_dir / "jobs.sqlite").is_file():
        raise ValueError(f"{state_dir}: no aspen run's state here (no jobs.sqlite); give --from the sweep's "
                         "output_dir (its file's output_dir: field)")
    holder = live_holder(state_dir)
    if holder is not None:
        raise ValueError(f"the service of {state_dir} is running ({holder}): cancel the sweep there "
                         f"(aspen sweep cancel {name}, with --url or --address where it is not this machine's)")
    table = JobTable(state_dir / "jobs.sqlite")
    try:
        core = SchedulerCore(table, FifoPolicy(), state_dir)

        def cancel(job_id: str, reason: str) -> None:
            _, stop = core.cancel(job_id, reason)
            if stop is not None:   # recorded running on a trainer that is gone with its service: ended here
                table.set_state(job_id, "cancelled", reason, trainer=None)

        book = SweepBook(state_dir, SchedulerJobs(core, table, cancel=cancel))
        answer = book.cancel(name, REASON)
        book.poll_all()   # its trials' jobs seen ended: the sweep ends cancelled, its leaderboard written
        return {**book.status(name), "problems": answer["problems"]}
    finally:
        table.close()
