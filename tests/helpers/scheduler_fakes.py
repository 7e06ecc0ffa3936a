"""Shared by the tests of the scheduler's Ray-free parts (event intake, trainer fleet): a clock the test
moves, a trainer's status, and a job table with jobs running on a trainer."""

from __future__ import annotations

from pathlib import Path

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from policies.base import Start
from policies.fifo import FifoPolicy
from tests.helpers.service import job_dict, run_spec, write_task_data

BUSY_S = 0.05   # how long a write waits for the holder's lock here (the service waits 2 s)


class Clock:
    """Monotonic seconds the test moves on (a fake `sleep` moves it too)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def status(trainer_id: str, jobs=()) -> TrainerStatus:
    return TrainerStatus(trainer_id=trainer_id, incarnation="x", base_model="smollm2-135m", quantization="none",
                         device="cpu", jobs=list(jobs), steps=0, tokens=0, padding_tokens=0, busy_seconds=0.0,
                         started_at=0.0, base_bytes=100 * 2**20, peak_memory_bytes=0,
                         memory_budget_bytes=10 * 2**30, activation_bytes_estimate=50 * 2**20,
                         linear_shapes={"model.layers.0.self_attn.q_proj": (64, 64),
                                        "model.layers.0.self_attn.v_proj": (64, 32)})


def running_jobs(tmp_path: Path, names=("a", "b"), trainer: str = "trainer-0") -> tuple[JobTable, SchedulerCore,
                                                                                          list[str]]:
    """A table and core with jobs started on `trainer` (its `started` events booked)."""
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(name, data, 10) for name in names])
    table = JobTable(tmp_path / "state/jobs.sqlite", busy_timeout=BUSY_S)
    core = SchedulerCore(table, FifoPolicy(), tmp_path / "state")
    ids = [r.id for r in core.submit_many(spec.submissions())]
    with table.transaction():
        assert core.plan([status(trainer)]) == [Start(job=i, trainer=trainer) for i in ids]
        for job_id in ids:
            core.apply_event(trainer, TrainerEvent(kind="started", job_id=job_id, step=0, data={"total_steps": 10}))
    return table, core, ids


def progress(job_id: str, step: int) -> TrainerEvent:
    return TrainerEvent(kind="progress", job_id=job_id, step=step, data={"step": step, "loss": 2.0 / step,
                                                                         "tokens": 100})
