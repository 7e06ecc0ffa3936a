"""`fifo`: queued jobs start in submission order on a trainer with their base model, as long as the
trainer's memory budget holds them; a job that does not fit waits, and jobs behind it may start where
they fit (no job is ever started past its trainer's budget). On a shared service, the least served user's
jobs first (fair share), each user's in submission order."""

from __future__ import annotations

from policies.base import Admission, Decision, Snapshot


class FifoPolicy:
    name = "fifo"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        admission = Admission(snapshot)
        return [admission.place(job) for job in sorted(snapshot.queued(), key=snapshot.fair_share)]
