"""Moving running jobs between trainers (`Move`): when one trainer holds much more queued work than
another that could run one of its jobs, the job is paused with a checkpoint at its next step boundary and
resumed from it on the other trainer.

The estimate: a trainer works through the tokens of its jobs at about the same rate whether they share
its fused steps or not, so it finishes after about its queued step tokens (`Admission.load`: the remaining
tokens of its jobs, those placed this round included) and the later of two trainers decides when both are
done. A job moves from trainer A to trainer B when

    max(load A − r, load B + r + cost)  ≤  (1 − margin) · max(load A, load B)

(r: the job's remaining tokens; cost: the checkpoint on A and the reload on B, as the larger of
`cost_steps` fused steps on B, the job's micro-batch included, and `cost_s` seconds of B's measured
tokens per second), i.e. only when the finish of the two improves by a clear margin after paying for the
move. Hysteresis: a job moved less than `cooldown_s` ago, one already pausing or on
its way to its trainer, is not moved; a trainer gives or takes at most one job per round; nothing moves
onto a trainer where a waiting job would fit (it takes the room first). Trainers are assumed to step
tokens at similar rates (same base model and hardware); moves are between trainers of the job's base."""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Admission, Decision, JobView, Move, Preempt, Snapshot, Start, Wait


@dataclass(frozen=True)
class MoveRule:
    margin: float = 0.2        # the later finish of the two trainers must improve by this share
    cost_steps: float = 10.0   # a move's checkpoint + reload, in fused steps on the target, and at least
    cost_s: float = 30.0       # this many seconds of the target's measured throughput (where measured)
    cooldown_s: float = 600.0  # a job moved less than this long ago stays where it is

    def __post_init__(self) -> None:
        if not 0.0 < self.margin < 1.0:
            raise ValueError(f"MoveRule: margin must be between 0 and 1 (exclusive), got {self.margin!r}")
        if min(self.cost_steps, self.cost_s, self.cooldown_s) < 0:
            raise ValueError(f"MoveRule: cost_steps, cost_s and cooldown_s must be >= 0, got {self.cost_steps!r}, "
                             f"{self.cost_s!r}, {self.cooldown_s!r}")

    def movable(self, job: JobView, snapshot: Snapshot, trainers: dict[str, tuple[str, ...]]) -> bool:
        return (job.state == "running" and job.trainer is not None and not job.preempting
                and job.moving_to is None and job.remaining_tokens > 0
                and job.id in trainers.get(job.trainer, ())          # on its trainer, not on its way there
                and (job.moved_at is None or snapshot.time - job.moved_at >= self.cooldown_s))

    def decide(self, snapshot: Snapshot, admission: Admission, decided: list[Decision]) -> list[Move]:
        """Moves worth making after this round's `decided` decisions (already booked in `admission`)."""
        busy = {d.job for d in decided if isinstance(d, (Preempt, Move))}
        waiting = [j for j in snapshot.queued() if any(isinstance(d, Wait) and d.job == j.id for d in decided)]
        trainers = {t.id: t.jobs for t in snapshot.trainers}
        by_id = {t.id: t for t in snapshot.trainers}
        jobs = {j.id: j for j in snapshot.jobs}
        step_tokens = {t.id: sum(j.tokens_per_step or 0.0 for j in snapshot.on_trainer(t.id) if not j.preempting)
                       for t in snapshot.trainers}
        for d in decided:
            if isinstance(d, Start) and d.trainer in step_tokens:
                step_tokens[d.trainer] += jobs[d.job].tokens_per_step or 0.0
        touched: set[str] = set()
        moves: list[Move] = []
        while True:
            best: tuple[float, JobView, str, float, float] | None = None
            for job in snapshot.jobs:
                if job.id in busy or job.trainer in touched or not self.movable(job, snapshot, trainers):
                    continue
                remaining = job.remaining_tokens
                source_load = admission.load[job.trainer]
                for target in admission.candidates(job):
                    if target.id == job.trainer or target.id in touched or not admission.fits(target, job):
                        continue
                    if any(admission.fits(target, w) for w in waiting if w.base_model == target.base_model
                           and w.quantization == target.quantization):
                        continue
                    before = max(source_load, admission.load[target.id])
                    cost = self.cost_steps * (step_tokens[target.id] + (job.tokens_per_step or 1.0))
                    if target.tokens_per_s:
                        cost = max(cost, self.cost_s * target.tokens_per_s)
                    after = max(source_load - remaining, admission.load[target.id] + remaining + cost)
                    if after <= (1.0 - self.margin) * before and (best is None or after - before < best[0]):
                        best = (after - before, job, target.id, before, after)
            if best is None:
                return moves
            _, job, target_id, before, after = best
            admission.release(job)
            admission.reserve(target_id, job)
            step_tokens[job.trainer] -= job.tokens_per_step or 0.0
            step_tokens[target_id] += job.tokens_per_step or 0.0
            touched |= {job.trainer, target_id}
            busy.add(job.id)
            moves.append(Move(job.id, target_id, f"moving from {job.trainer} to {by_id[target_id].id}: queued step "
                                                 f"tokens ~{before:.0f} -> ~{after:.0f} for the later of the two "
                                                 f"(the move's cost included)"))
