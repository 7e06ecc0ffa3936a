"""A fake job service for a SweepBook (actors/service/sweeps/sweep_book.py): trials that train by a planted loss curve,
and a small grid sweep over them (tests/unit/service/test_sweep_book.py, test_sweep_metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.spec.sweep_spec import SweepSpec

JOB = {"name": "qa", "data": "qa.jsonl", "format": {"type": "alpaca"}, "max_steps": 8, "eval_split": 4,
       "eval_every": 2}


@dataclass
class Record:
    state: str
    step: int
    reason: str = ""


class FakeJobs:
    """Jobs that advance two steps (one evaluation) each `advance()`, eval loss falling with the lr's distance
    to 1e-3; cancel ends them."""

    def __init__(self):
        self.jobs: dict[str, dict] = {}

    def submit(self, job, *, job_id, base_model, seed, output_dir, user=None) -> str:
        if job_id not in self.jobs:   # one entered before under this id: that one (as the scheduler answers)
            self.jobs[job_id] = {"spec": job, "step": 0, "state": "running", "rows": []}
        return job_id

    def folder_problem(self, job, *, base_model, seed, output_dir, user=None) -> str | None:
        return None

    def check_quota(self, job, *, base_model, seed, output_dir, user=None) -> None:
        return None

    def advance(self) -> None:
        for job in self.jobs.values():
            if job["state"] != "running":
                continue
            job["step"] += 2
            loss = 1.0 + abs(job["spec"].lr - 1e-3) * 100 + 1.0 / job["step"]
            row = {"step": job["step"], "loss": loss, "eval_loss": loss}
            if job["spec"].eval_generate is not None:   # a score that rises as the loss falls, as the table has it
                row["eval_score"] = 1.0 / loss
            job["rows"].append(row)
            if job["step"] >= job["spec"].max_steps:
                job["state"] = "completed"

    def status(self, job_id):
        job = self.jobs[job_id]
        return Record(job["state"], job["step"])

    def losses(self, job_id):
        return list(self.jobs[job_id]["rows"])

    def cancel(self, job_id, reason):
        self.jobs[job_id]["state"] = "cancelled"

    def job_ids(self):
        return set(self.jobs)

    def moved(self, job_id, old_dir, new_dir) -> bool:
        if job_id in self.jobs:
            self.jobs[job_id]["moved_to"] = new_dir
        return True


def spec(name: str, folder: Path) -> SweepSpec:
    return SweepSpec(name=name, output_dir=str(folder / name), job=JOB, search="grid", max_concurrent=2,
                     space={"lr": {"choice": [1e-3, 3e-3, 1e-2]}})
