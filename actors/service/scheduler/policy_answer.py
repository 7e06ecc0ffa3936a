"""What the scheduler makes of a policy's answer for the queued jobs (a policy may be third-party code). A `Start`
carried out as given ran one job on two trainers at once (started twice in one round), on a trainer of another base
model, past a trainer's memory budget or `max_jobs`, or past its user's quota (running jobs, tokens a day): a Start
the built-in policies' placement (`Admission`, policies/base.py) would never make is refused, the job staying
queued, its reason saying what the policy asked and why it was not done, and the scheduler says it once per policy
and job (its log, the service info's `policy_warnings`); the round's other decisions go on. A queued job the policy
gave neither a Start nor a Wait waited with the reason it had ("submitted"), which said nothing of the policy: its
reason now says that the policy left it undecided.

The policy decides on the round's snapshot with the service's lock released (scheduler_core.py); a Start was checked
against that snapshot's trainers alone, so memory taken on a trainer meanwhile (an interactive model opened there,
another job started there) was not counted and the job started past the trainer's budget. Each Start is now checked
against the trainers as they are when it is applied too (`StartCheck`: the jobs running on them since the snapshot
counted, those that left them since, ended, paused or preempted, given back); one that no longer fits is not carried
out, not the policy's fault (nothing is said against it): the job stays queued, its reason says what took the room,
and the next round decides again. What left was once not given back (the safe side): a Start that fitted beside an
interactive model opened meanwhile, in the room a job that ended meanwhile freed, waited a round (or more) for
nothing; a job that left and one that started in the same window now net out, each counted as the snapshot or the
scheduler's estimate counts it (what the next round's snapshot counts)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

from actors.service.table.job_table import JobRecord, JobTable
from policies.base import Admission, Decision, JobView, Move, Snapshot, Start, TrainerView, Wait, compatible

log = logging.getLogger(__name__)


class Placed(NamedTuple):
    """A job on a trainer where the snapshot and the table now differ: one running there now that the snapshot did
    not show running there (started since), or one the snapshot showed running there that has left it since."""

    job: str
    trainer: str
    user: str | None
    memory_bytes: int


class StartCheck:
    """The round's Starts so far, counted on their trainers as a policy's `Admission` counts them, on the snapshot
    and on the trainers now: with the jobs started on them since the snapshot (`since`) and without those that left
    them since (`left`: ended, paused, preempted), each by what the snapshot counted for it."""

    def __init__(self, snapshot: Snapshot, records: Sequence[JobRecord] = (),
                 memory: Callable[[str], int] = lambda job_id: 0):
        """`records`: the active jobs in the table now; `memory`: a job's memory as the scheduler estimates it."""
        self.admission = Admission(snapshot)
        self.now = Admission(snapshot)
        self.trainers = {t.id: t for t in snapshot.trainers}
        self.started: dict[str, str] = {}   # job id -> the trainer it starts on this round
        self.since: list[Placed] = []       # the jobs started on the trainers since the snapshot
        self.left: list[Placed] = []        # the jobs the snapshot shows running that have left their trainers since
        seen = {j.id: (j.state, j.trainer) for j in snapshot.jobs}
        now = {r.id: (r.state, r.trainer) for r in records}
        for record in records:
            if record.state != "running" or not record.trainer or seen.get(record.id) == ("running", record.trainer):
                continue
            if record.trainer in self.trainers:
                self.since.append(Placed(record.id, record.trainer, record.user, memory(record.id)))
                self.now.hold(record.trainer, self.since[-1].memory_bytes, record.user)
        for job in snapshot.jobs:
            if job.state == "running" and job.trainer in self.trainers and now.get(job.id) != ("running", job.trainer):
                self.left.append(Placed(job.id, job.trainer, job.user, job.memory_bytes or 0))
                self.now.drop(job.trainer, self.left[-1].memory_bytes, job.user)

    def refusal(self, job: JobView, trainer_id: str) -> str | None:
        """Why `job` cannot start on `trainer_id` by the snapshot, which the policy saw (the policy's mistake); None
        where it can (`count` then counts it there)."""
        if job.id in self.started:
            return f"it was already started on {self.started[job.id]} in this round (one job runs on one trainer)"
        trainer = self.trainers.get(trainer_id)
        if trainer is None:
            return f"there is no trainer {trainer_id!r} (trainers now: {', '.join(sorted(self.trainers)) or 'none'})"
        if not compatible(job, trainer):
            return (f"{trainer_id} holds base model '{trainer.base_model}' ({trainer.quantization}), not the job's "
                    f"'{job.base_model}' ({job.quantization})")
        if (quota := self.admission.quota_reason(job)) is not None:
            return f"its user's quota holds it back ({quota})"
        if not self.admission.has_slot(trainer):
            return (f"{trainer_id} has no free job slot (its max_jobs {trainer.max_jobs}, or its node's "
                    "job_processes_per_node)")
        need, free = job.memory_bytes or 0, self.admission.free(trainer)
        if free < need:
            return (f"it needs {need / 2**20:.0f} MiB and {trainer_id}'s memory budget has {max(free, 0) / 2**20:.0f} "
                    "MiB free (with the jobs on it and those started before it this round)")
        return None

    def taken_since(self, job: JobView, trainer_id: str) -> str | None:
        """Why `job`, which fits `trainer_id` by the snapshot (`refusal`), no longer does with the trainers as they
        are now (the jobs started since taking their memory, slots and users' quota, those that left giving theirs
        back); None where it still fits."""
        if not self.since:
            return None   # only what started since can take room: what left gives room back
        trainer, need = self.trainers[trainer_id], job.memory_bytes or 0
        why = (self.now.quota_reason(job)
               or (None if self.now.has_slot(trainer) else no_slot_now(self.now, trainer))
               or (None if self.now.free(trainer) >= need else
                   f"it needs {need / 2**20:.1f} MiB and {trainer_id}'s memory budget has "
                   f"{max(self.now.free(trainer), 0) / 2**20:.1f} MiB free now"))
        if why is None:
            return None
        node = trainer.node
        near = [s for s in self.since if s.trainer == trainer_id or s.user == job.user
                or (node is not None and self.trainers[s.trainer].node == node)] or self.since
        where = sorted({s.trainer for s in near}, key=lambda t: (t != trainer_id, t))   # the Start's trainer first
        taken = " and ".join(", ".join(f"{s.job} ({s.memory_bytes / 2**20:.1f} MiB)" for s in near if s.trainer == t)
                             + f" started on {t}" for t in where)
        it = "it" if where == [trainer_id] else trainer_id
        given = "".join(f" and {s.job} ({s.memory_bytes / 2**20:.1f} MiB) left {it}" for s in self.left
                        if s.trainer == trainer_id)
        return f"while the policy decided, {taken}{given}: {why}"

    def count(self, job: JobView, trainer_id: str) -> None:
        """Count the job on `trainer_id` from now on in this round."""
        self.admission.reserve(trainer_id, job)
        self.now.reserve(trainer_id, job)
        self.started[job.id] = trainer_id


def no_slot_now(admission: Admission, trainer: TrainerView) -> str:
    """Which of the trainer's slot limits the jobs on it now reach: its `max_jobs`, or its node's job slots."""
    count = admission.count[trainer.id]
    if trainer.max_jobs is not None and count >= trainer.max_jobs:
        return f"{trainer.id} has no free job slot now (it runs {count} jobs, its max_jobs {trainer.max_jobs})"
    return (f"{trainer.id} has no free job slot now (its node runs {admission.node_count.get(trainer.node, 0)} "
            "jobs, its job_processes_per_node)")


def refuse_start(table: JobTable, policy: str, job: JobView, decision: Start, why: str,
                 warn: Callable[[str, str], None]) -> None:
    """Say a refused Start (`warn`: PolicyGuard.warn, once per policy and job) and, where the job still waits, say
    why in its reason."""
    warn(f"{policy} refused start {job.id}", f"policy {policy} started job {job.id} on {decision.trainer}, not done: "
         f"{why}")
    if why.startswith("it was already started"):
        return   # it starts on the first trainer: that reason stands
    table.set_reason(job.id, f"waiting: the scheduling policy '{policy}' started it on {decision.trainer}, but {why}; "
                             "it stays queued until the policy places it where it fits (Admission.place, "
                             "policies/base.py, does)")


def wait_taken(table: JobTable, policy: str, job: JobView, decision: Start, why: str) -> None:
    """A Start that no longer fits (`StartCheck.taken_since`): not carried out, the job's reason says why."""
    log.info("scheduler: policy %s's start of job %s on %s not done: %s", policy, job.id, decision.trainer, why)
    table.set_reason(job.id, f"waiting: the scheduling policy '{policy}' started it on {decision.trainer}, but {why}; "
                             "it stays queued and the next round decides again")


def leave_reasons(table: JobTable, policy: str, snapshot: Snapshot, decisions: list[Decision]) -> None:
    """Give each queued job the policy neither started nor said why it waits (no Start or Wait for it) a reason that
    says so; not a job no longer queued in the table (one the policy guard parked this round keeps its reason)."""
    answered = {d.job for d in decisions if isinstance(d, (Start, Wait))}
    for job in snapshot.queued():
        if job.id not in answered and table.get(job.id).state == "queued":
            table.set_reason(job.id, f"waiting: the scheduling policy '{policy}' neither started it nor said why it "
                                     "waits (no Start or Wait for it in its decisions); it stays queued until the "
                                     "policy starts it")


def move_refusal(job: JobView, decision: Move, trainers: dict[str, set[str]]) -> str | None:
    """Why a Move of `job` cannot be carried out (`trainers`: each trainer's id and the jobs it runs now); None
    where it can."""
    if job.state != "running" or not job.trainer:
        return "it does not run (only a running job can be moved)"
    if decision.trainer not in trainers:
        return f"there is no trainer {decision.trainer!r} (trainers now: {', '.join(sorted(trainers)) or 'none'})"
    if decision.trainer == job.trainer:
        return "it runs there already"
    if job.id not in trainers.get(job.trainer, ()):
        return f"{job.trainer} does not report it running yet (it is starting there)"
    if job.preempting:
        return "it is being preempted or moved already"
    return None
