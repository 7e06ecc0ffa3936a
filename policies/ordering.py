"""Policies that order the queue and may preempt:

- `sjf`: shortest (predicted) remaining work first: remaining optimizer steps (an early-stop
  prediction shortens them) times the job's tokens per step.
- `priority`: highest `priority` first (then submission order). A queued job that does not fit pauses
  lower-priority running jobs on a trainer with its base model (at their next step boundary, with a
  checkpoint; they are queued again and resume where they were) until it fits.
- `adaptive` (the default; the ASPEN scheduler): weighted shortest predicted remaining work first, one
  priority level weighing 4x the work; memory-aware admission; preemption where the difference is worth
  a checkpoint (4x); aging so that a long job is not starved (each hour queued adds a level).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from policies.base import Admission, Decision, JobView, Preempt, Snapshot, Start, Wait
from policies.moves import MoveRule


def outranks(job: JobView, victim: JobView) -> bool:
    return victim.priority < job.priority


def plan(snapshot: Snapshot, key: Callable[[JobView], tuple], *, preempt: bool,
         may_preempt: Callable[[JobView, JobView], bool] = outranks, moves: MoveRule | None = None) -> list[Decision]:
    """Place queued jobs by their users' fair share (`Snapshot.fair_share`), then in `key` order; with
    `preempt`, make room for a job by pausing running jobs that `may_preempt(job, victim)` allows (by
    default: lower priority) on a compatible trainer (lowest priority, then most remaining work, first);
    with `moves`, then move running jobs where it pays."""
    admission = Admission(snapshot)
    decisions: list[Decision] = []
    preempted: set[str] = set()
    for job in sorted(snapshot.queued(), key=lambda j: (snapshot.fair_share(j), key(j))):
        placed = admission.place(job)
        if isinstance(placed, Start) or not preempt or not admission.candidates(job):
            decisions.append(placed)
            continue
        room = _make_room(snapshot, admission, job, may_preempt, preempted)
        if room is None:
            decisions.append(placed)
            continue
        trainer_id, victims = room
        for victim in victims:
            preempted.add(victim.id)
            admission.release(victim)
            why = (f"priority {job.priority} > {victim.priority}" if victim.priority < job.priority else
                   f"~{job.remaining_tokens:.0f} tokens left vs its ~{victim.remaining_tokens:.0f}")
            decisions.append(Preempt(victim.id, f"making room on {trainer_id} for {job.id} ({why})"))
        decisions.append(Wait(job.id, f"waiting for {len(victims)} preempted job(s) on {trainer_id} to pause",
                              "priority"))
        admission.reserve(trainer_id, job)   # reserved: nothing else takes it this round
    if moves is not None:
        decisions.extend(moves.decide(snapshot, admission, decisions))
    return decisions


def _make_room(snapshot: Snapshot, admission: Admission, job: JobView,
               may_preempt: Callable[[JobView, JobView], bool],
               already: set[str]) -> tuple[str, list[JobView]] | None:
    """The fewest preemptible running jobs on one compatible trainer whose pausing frees enough memory
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
                   if not j.preempting and j.id not in already and may_preempt(job, j)]
        running.sort(key=lambda j: (j.priority, -j.remaining_tokens))
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
    """Weighted shortest remaining work first (Smith's rule, which minimises weighted mean turnaround): a
    job's score is its predicted remaining tokens / `priority_weight` ** its priority, lowest first, so
    one priority level counts as `priority_weight` (4) times less work. A queued job preempts a running
    one whose score is at least `preempt_ratio` (4) times its own: a job one level higher and no bigger,
    or of the same level with a quarter of the work left. Waiting ages a job: every `aging_s` queued
    adds a level (in whole levels, so that jobs of one level still go shortest-first).

    `moves` (default `MoveRule()`; None: never) moves a running job to a less loaded trainer when the
    later of the two trainers' estimated finishes improves by its margin, the move's cost included.

    Scores are kept as logarithms (`log_score`), so that no priority, age or amount of work can overflow:
    4 ** 600 does not fit a float, 600 * log(4) does."""

    name = "adaptive"

    def __init__(self, aging_s: float = 3600.0, preempt_ratio: float = 4.0, priority_weight: float = 4.0,
                 moves: MoveRule | None = MoveRule()):
        for name, value, low in (("aging_s", aging_s, 0.0), ("preempt_ratio", preempt_ratio, 1.0),
                                 ("priority_weight", priority_weight, 1.0)):
            if not math.isfinite(value) or value <= low:
                raise ValueError(f"AdaptivePolicy: {name} must be a finite number > {low:g}, got {value!r}")
        self.aging_s = aging_s
        self.preempt_ratio = preempt_ratio
        self.priority_weight = priority_weight
        self.log_weight = math.log(priority_weight)
        self.log_ratio = math.log(preempt_ratio)
        self.moves = moves

    def effective_priority(self, job: JobView, now: float) -> float:
        waited = max(now - job.submitted_at, 0.0) if job.state == "queued" else 0.0
        return job.priority + waited // self.aging_s

    def log_score(self, job: JobView, now: float) -> float:
        """log(remaining tokens / priority_weight ** effective priority); -inf for a job with nothing left."""
        remaining = job.remaining_tokens
        if not remaining > 0:    # also NaN: a job with no measurable work left sorts first
            return -math.inf
        return math.log(remaining) - self.effective_priority(job, now) * self.log_weight

    def score(self, job: JobView, now: float) -> float:
        """The score itself (0.0 or inf where it leaves a float's range; ordering uses `log_score`)."""
        try:
            return math.exp(self.log_score(job, now))
        except OverflowError:
            return math.inf

    def order(self, job: JobView, now: float) -> tuple:
        return (self.log_score(job, now), -job.priority, job.submitted_at, job.id)

    def requeued(self, victim: JobView, now: float) -> tuple[tuple, float]:
        """A running job's order and log score if it were queued again."""
        again = replace(victim, state="queued")
        return self.order(again, now), self.log_score(again, now)

    def may_preempt(self, job: JobView, victim: JobView, now: float,
                    requeued: tuple[tuple, float] | None = None) -> bool:
        """Worth a checkpoint and a restart; never a victim that, queued again, would come first: it
        would take the room back and the two would take turns. `requeued`: `self.requeued(victim, now)`,
        if already known."""
        order, log_score = requeued if requeued is not None else self.requeued(victim, now)
        return self.order(job, now) < order and log_score >= self.log_ratio + self.log_score(job, now)

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        now = snapshot.time
        requeued: dict[str, tuple[tuple, float]] = {}   # per victim, once per round (not once per queued job)

        def may_preempt(job: JobView, victim: JobView) -> bool:
            if victim.id not in requeued:
                requeued[victim.id] = self.requeued(victim, now)
            return self.may_preempt(job, victim, now, requeued[victim.id])

        return plan(snapshot, lambda j: self.order(j, now), preempt=True, may_preempt=may_preempt, moves=self.moves)
