"""Policies that order the queue and may preempt:

- `sjf`: shortest (predicted) remaining work first: remaining optimizer steps (an early-stop
  prediction shortens them) times the job's tokens per step.
- `priority`: highest `priority` first (then submission order). A queued job that does not fit pauses
  lower-priority running jobs on a trainer with its base model (at their next step boundary, with a
  checkpoint; they are queued again and resume where they were) until it fits.
- `adaptive` (the default; the ASPEN scheduler): priorities first, shortest predicted remaining work
  within a priority, memory-aware admission, preemption for higher priorities only, and aging so that a
  long job is not starved: every `aging_s` seconds of waiting counts as one priority level.
"""

from __future__ import annotations

from collections.abc import Callable

from policies.base import Admission, Decision, JobView, Preempt, Snapshot, Start, Wait


def plan(snapshot: Snapshot, key: Callable[[JobView], tuple], *, preempt: bool,
         rank: Callable[[JobView], float] = lambda j: j.priority) -> list[Decision]:
    """Place queued jobs in `key` order; with `preempt`, make room for a job by pausing running jobs of
    lower `rank` on a compatible trainer (lowest rank, then least progress lost, first)."""
    admission = Admission(snapshot)
    decisions: list[Decision] = []
    preempted: set[str] = set()
    for job in sorted(snapshot.queued(), key=key):
        placed = admission.place(job)
        if isinstance(placed, Start) or not preempt or not admission.candidates(job):
            decisions.append(placed)
            continue
        room = _make_room(snapshot, admission, job, rank, preempted)
        if room is None:
            decisions.append(placed)
            continue
        trainer_id, victims = room
        for victim in victims:
            preempted.add(victim.id)
            admission.release(victim)
            decisions.append(Preempt(victim.id, f"making room on {trainer_id} for {job.id} "
                                                f"(priority {job.priority} > {victim.priority})"))
        decisions.append(Wait(job.id, f"waiting for {len(victims)} lower-priority job(s) on {trainer_id} to pause",
                              "priority"))
        admission.used[trainer_id] += job.memory_bytes or 0   # reserved: nothing else takes it this round
        admission.count[trainer_id] += 1
    return decisions


def _make_room(snapshot: Snapshot, admission: Admission, job: JobView, rank: Callable[[JobView], float],
               already: set[str]) -> tuple[str, list[JobView]] | None:
    """The fewest lower-ranked running jobs on one compatible trainer whose pausing frees enough memory
    and a job slot; None if none do, or if jobs already pausing will make the room."""
    need = job.memory_bytes or 0

    def roomy(trainer, free: int, count: int) -> bool:
        return free >= need and (trainer.max_jobs is None or count < trainer.max_jobs)

    best: tuple[str, list[JobView]] | None = None
    for trainer in admission.candidates(job):
        pausing = [j for j in snapshot.on_trainer(trainer.id) if j.preempting]
        if pausing and roomy(trainer, admission.free(trainer) + admission.releasing[trainer.id],
                             admission.count[trainer.id] - len(pausing)):
            return None                    # jobs already pausing there will make room: wait for them
        running = [j for j in snapshot.on_trainer(trainer.id)
                   if not j.preempting and j.id not in already and rank(j) < rank(job)]
        running.sort(key=lambda j: (rank(j), j.step))
        free, count, victims = admission.free(trainer), admission.count[trainer.id], []
        for victim in running:
            if roomy(trainer, free, count):
                break
            victims.append(victim)
            free += victim.memory_bytes or 0
            count -= 1
        if roomy(trainer, free, count) and victims and (best is None or len(victims) < len(best[1])):
            best = (trainer.id, victims)
    return best


class SjfPolicy:
    name = "sjf"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return plan(snapshot, lambda j: (j.remaining_tokens, j.submitted_at, j.id), preempt=False)


class PriorityPolicy:
    name = "priority"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return plan(snapshot, lambda j: (-j.priority, j.submitted_at, j.id), preempt=True)


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, aging_s: float = 600.0):
        self.aging_s = aging_s

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        def effective(job: JobView) -> float:
            waited = max(snapshot.time - job.submitted_at, 0.0) if job.state == "queued" else 0.0
            return job.priority + waited / self.aging_s

        return plan(snapshot, lambda j: (-effective(j), j.remaining_tokens, j.submitted_at, j.id), preempt=True,
                    rank=lambda j: j.priority)
