"""An example third-party policy: FIFO with at most `max_jobs` jobs per trainer (the fixed concurrency of
mLoRA's dispatcher), on top of aspen's memory-aware admission.

Installed as a package, it is found by its entry point (`policy: fixed-concurrency`); set the limit with
the environment variable ASPEN_MAX_JOBS_PER_TRAINER (default 2)."""

from __future__ import annotations

import os

from policies.base import Admission, Decision, Snapshot, Start, Wait


class FixedConcurrencyPolicy:
    name = "fixed-concurrency"

    def __init__(self, max_jobs: int | None = None):
        self.max_jobs = max_jobs or int(os.environ.get("ASPEN_MAX_JOBS_PER_TRAINER", "2"))

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        admission = Admission(snapshot)
        count = {t.id: len(snapshot.on_trainer(t.id)) for t in snapshot.trainers}
        decisions: list[Decision] = []
        for job in snapshot.queued():
            open_trainers = [t for t in admission.candidates(job) if count[t.id] < self.max_jobs]
            if admission.candidates(job) and not open_trainers:
                decisions.append(Wait(job.id, f"every trainer already runs {self.max_jobs} jobs"))
                continue
            decision = admission.place(job)
            if isinstance(decision, Start):
                if count[decision.trainer] >= self.max_jobs:       # placed on a full trainer: undo
                    admission.unreserve(decision.trainer, job)
                    decisions.append(Wait(job.id, f"every trainer already runs {self.max_jobs} jobs"))
                    continue
                count[decision.trainer] += 1
            decisions.append(decision)
        return decisions
