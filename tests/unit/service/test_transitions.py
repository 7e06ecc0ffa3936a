"""A job's history has one row per change of state (issue: under load a running job's transitions read `queued ->
running -> running`, two rows with nothing between). A new reason within the same state (starting on a trainer,
then training there, resumed from a step) amends the row that entered the state; readers in other threads, through
their own connections, never see two rows of the same state in a row."""

from __future__ import annotations

import sqlite3
import threading

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.base import Start
from policies.fifo import FifoPolicy
from tests.helpers.scheduler_fakes import status
from tests.helpers.service import job_dict, run_spec, write_task_data


def _states_in_a_row(rows: list[tuple]) -> list[str]:
    return [state for (_, state, _), (_, previous, _) in zip(rows[1:], rows, strict=False) if state == previous]


def test_one_row_per_change_of_state_while_readers_read(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict("job", data, 100)])
    path = tmp_path / "state/jobs.sqlite"
    core = SchedulerCore(JobTable(path), FifoPolicy(), tmp_path / "state")
    core.submit_many(spec.submissions(), job_ids=["job"])
    stop, seen, doubled = threading.Event(), [], []

    def read() -> None:   # another process's view: its own connection, reading while the scheduler writes
        connection = sqlite3.connect(path, timeout=30)
        while not stop.is_set():
            rows = connection.execute("SELECT time, state, reason FROM transitions WHERE job_id = 'job' "
                                      "ORDER BY rowid").fetchall()
            seen.append(len(rows))
            doubled.extend(_states_in_a_row(rows))
        connection.close()

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    try:
        for round_ in range(20):   # started, trained (resumed after the first round), given back: again and again
            with core.table.transaction():
                assert core.plan([status("trainer-0")]) == [Start(job="job", trainer="trainer-0")]
                core.apply_event("trainer-0", TrainerEvent(kind="started", job_id="job", step=10 * round_, data={
                    "total_steps": 100, **({"resumed_from": 10 * round_, "history": []} if round_ else {})}))
            with core.table.transaction():
                core.apply_event("trainer-0", TrainerEvent(kind="paused", job_id="job", step=10 * round_ + 5,
                                                           data={"reason": "paused by its user"}))
            core.resume("job", "resumed by its user")
    finally:
        stop.set()
        for reader in readers:
            reader.join()
    rows = core.table.transitions.of_job("job")
    assert not doubled and not _states_in_a_row(rows)
    assert max(seen) > 1   # the readers read while rows were written
    states = [state for _, state, _ in rows]
    assert states == ["queued"] + ["running", "paused", "queued"] * 20
    running = [reason for _, state, reason in rows if state == "running"]
    assert running[0] == "starting on trainer-0; then training on trainer-0"
    assert running[1] == "starting on trainer-0; then training on trainer-0, resumed from step 10"
