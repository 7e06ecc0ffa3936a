"""Whether the scheduler can carry out a policy's `Start`: a policy may be third-party code, and a Start carried out
as given ran one job on two trainers at once (started twice in one round), on a trainer of another base model, or
past a trainer's memory budget or `max_jobs`. A Start the built-in policies' placement (`Admission`, policies/base.py)
would never make is refused: the job stays queued, its reason saying what the policy asked and why it was not done,
and the scheduler logs it; the round's other decisions go on."""

from __future__ import annotations

import logging

from actors.service.table.job_table import JobTable
from policies.base import Admission, JobView, Snapshot, Start, compatible

log = logging.getLogger(__name__)


class StartCheck:
    """The round's Starts so far, counted on their trainers as a policy's `Admission` counts them."""

    def __init__(self, snapshot: Snapshot):
        self.admission = Admission(snapshot)
        self.trainers = {t.id: t for t in snapshot.trainers}
        self.started: dict[str, str] = {}   # job id -> the trainer it starts on this round

    def refusal(self, job: JobView, trainer_id: str) -> str | None:
        """Why `job` cannot start on `trainer_id` now; None where it can (it is then counted there)."""
        if job.id in self.started:
            return f"it was already started on {self.started[job.id]} in this round (one job runs on one trainer)"
        trainer = self.trainers.get(trainer_id)
        if trainer is None:
            return f"there is no trainer {trainer_id!r} (trainers now: {', '.join(sorted(self.trainers)) or 'none'})"
        if not compatible(job, trainer):
            return (f"{trainer_id} holds base model '{trainer.base_model}' ({trainer.quantization}), not the job's "
                    f"'{job.base_model}' ({job.quantization})")
        if not self.admission.has_slot(trainer):
            return (f"{trainer_id} has no free job slot (its max_jobs {trainer.max_jobs}, or its node's "
                    "job_processes_per_node)")
        need, free = job.memory_bytes or 0, self.admission.free(trainer)
        if free < need:
            return (f"it needs {need / 2**20:.0f} MiB and {trainer_id}'s memory budget has {max(free, 0) / 2**20:.0f} "
                    "MiB free (with the jobs on it and those started before it this round)")
        self.admission.reserve(trainer_id, job)
        self.started[job.id] = trainer_id
        return None


def refuse_start(table: JobTable, policy: str, job: JobView, decision: Start, why: str) -> None:
    """Log a refused Start and, where the job still waits, say why in its reason."""
    log.warning("scheduler: policy %s started job %s on %s, not done: %s", policy, job.id, decision.trainer, why)
    if why.startswith("it was already started"):
        return   # it starts on the first trainer: that reason stands
    table.set_reason(job.id, f"waiting: the scheduling policy '{policy}' started it on {decision.trainer}, but {why}; "
                             "it stays queued until the policy places it where it fits (Admission.place, "
                             "policies/base.py, does)")
