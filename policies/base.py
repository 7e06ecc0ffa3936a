"""The policy interface: a policy is a plain Python class (no Ray inside) that looks at an immutable
snapshot of the service and returns decisions.

    class MyPolicy:
        name = "mine"
        def decide(self, snapshot: Snapshot) -> list[Decision]:
            ...

Decisions: `Start(job, trainer)` puts a queued job on a trainer; `Preempt(job, reason)` pauses a running
job at its next step boundary (checkpointed; it is queued again); `Move(job, trainer, reason)` pauses a
running job the same way and resumes it from that checkpoint on another trainer (with the same base);
`Wait(job, reason)` says why a queued job stays queued (shown to users).

Placement (`Admission.place`, which every built-in policy uses): among the trainers holding the job's base
where it fits (memory budget, `max_jobs`), the least loaded by queued step tokens (the remaining tokens of
the jobs on it, including those placed earlier in the same round), then the one with the most free memory,
then the lowest trainer id; so no trainer idles while a job that fits it waits.

Users (a shared service's: `JobView.user`, `Snapshot.users`): every built-in policy orders the queue by the
users' fair share first (`Snapshot.fair_share`: the tokens a user's jobs trained over the service's window,
per unit of their share; the least served user's jobs first), then by its own rule within that; and
`Admission.place` keeps a user within their quotas (running jobs at once, tokens a day: cause `quota`).

A policy may also choose which jobs' next micro-batches share each fused step: a `compose_step` method
(see `StepComposer`) is called by every trainer before each step; without one, trainers take the jobs
round-robin while the step stays within its token budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class TrainerView:
    id: str
    base_model: str
    quantization: str
    memory_budget_bytes: int
    base_bytes: int                 # the frozen base's weights
    step_memory_bytes: int          # a step's memory over the base: measured peak, else the estimate
    jobs: tuple[str, ...]
    linear_shapes: tuple[tuple[str, int, int], ...]   # (module name, in_features, out_features)
    max_jobs: int | None = None     # a cap on jobs at once, where configured
    # the trainer holding no job: its weights and a full step by its first (cautious, unfitted) estimate;
    # what "this job can never run here" is judged against (a model fitted while jobs are held can fold
    # their adapters into its constant)
    empty_bytes: int | None = None
    tokens_per_s: float | None = None   # real tokens it steps per second of its steps, once measured
    node: str | None = None         # the node it runs on: its jobs' actors run there (Snapshot.job_slots)
    expert_shapes: tuple[tuple[str, int, int, int], ...] = ()   # MoE stacks: (name, experts, in, out)
    host_budget: bool = False       # its budget is the host's memory (a CPU trainer): host copies count in it


@dataclass(frozen=True, kw_only=True)
class JobView:
    id: str
    name: str
    state: str
    priority: int
    submitted_at: float
    base_model: str
    quantization: str
    trainer: str | None
    step: int
    total_steps: int | None
    memory_bytes: int | None        # the job's own memory on a trainer (adapter, gradients, optimizer state)
    tokens_per_step: float | None = None          # measured so far, else estimated from the spec
    predicted_remaining_steps: int | None = None  # where a stop rule predicts an early end
    preempting: bool = False                      # asked to pause; its memory frees at its next step
    moving_to: str | None = None                  # being moved there (pausing on `trainer`, then resumed there)
    moved_at: float | None = None                 # when it was last moved (snapshot time), if ever
    user: str | None = None                       # who submitted it (None: an operator)

    @property
    def remaining_steps(self) -> int:
        planned = (self.total_steps or 0) - self.step
        if self.predicted_remaining_steps is not None:
            return max(0, min(planned,
                              self.predicted_remaining_steps)) if self.total_steps else self.predicted_remaining_steps
        return max(planned, 0)

    @property
    def remaining_tokens(self) -> float:
        return self.remaining_steps * (self.tokens_per_step or 1.0)


@dataclass(frozen=True, kw_only=True)
class UserShare:
    """A user's standing: their share's weight, the tokens their jobs trained over the fair-share window,
    and their quotas (None: no limit)."""

    share: float = 1.0
    trained_tokens: float = 0.0
    max_running: int | None = None
    tokens_per_day: int | None = None
    tokens_today: float = 0.0            # trained over the last 24 hours

    @property
    def out_of_tokens(self) -> bool:
        return self.tokens_per_day is not None and self.tokens_today >= self.tokens_per_day


@dataclass(frozen=True)
class Snapshot:
    time: float
    trainers: tuple[TrainerView, ...]
    jobs: tuple[JobView, ...]
    # node -> running jobs it holds at most (each job's actor is a process on its trainer's node, with host
    # memory of its own); a node not named has no such limit
    job_slots: dict[str, int] = field(default_factory=dict)
    # user -> their standing (users.json's and the job table's); jobs of a user not named (an operator's,
    # None) count as a user of share 1 with what they trained
    users: dict[str | None, UserShare] = field(default_factory=dict)

    def fair_share(self, job: JobView) -> float:
        """The job's user's trained tokens per unit of share: lower is served first."""
        standing = self.users.get(job.user)
        return 0.0 if standing is None else standing.trained_tokens / standing.share

    def queued(self) -> list[JobView]:
        return sorted((j for j in self.jobs if j.state == "queued"), key=lambda j: (j.submitted_at, j.id))

    def on_trainer(self, trainer_id: str) -> list[JobView]:
        """The jobs running on a trainer (looked up, not scanned: a policy asks once per queued job)."""
        return list(self._running_by_trainer.get(trainer_id, ()))

    @cached_property
    def _running_by_trainer(self) -> dict[str, list[JobView]]:
        running: dict[str, list[JobView]] = {}
        for job in self.jobs:
            if job.state == "running" and job.trainer is not None:
                running.setdefault(job.trainer, []).append(job)
        return running


@dataclass(frozen=True)
class Start:
    job: str
    trainer: str


@dataclass(frozen=True)
class Preempt:
    job: str
    reason: str


@dataclass(frozen=True)
class Move:
    """Pause a running job at its next step boundary (checkpointed) and resume it on `trainer`."""

    job: str
    trainer: str
    reason: str


# the causes a Wait is counted under in the metrics (a label each); a plug-in's other causes are counted as "other"
# (their text added to the job's reason), so that its free-form causes do not grow Prometheus's label set unbounded
WAIT_CAUSES = ("memory", "slots", "host", "no_trainer", "priority", "quota", "other")


@dataclass(frozen=True)
class Wait:
    job: str
    reason: str
    cause: str = "other"   # one of WAIT_CAUSES (counted in the metrics)


Decision = Start | Preempt | Move | Wait


@runtime_checkable
class Policy(Protocol):
    name: str

    def decide(self, snapshot: Snapshot) -> list[Decision]: ...


@dataclass(frozen=True)
class NextBatch:
    """A job's next micro-batch, as a step composer sees it."""

    job: str
    lengths: tuple[int, ...]     # its sequences' token counts
    waited: int                  # fused steps since the job last took part in one
    priority: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@runtime_checkable
class StepComposer(Protocol):
    def compose_step(self, batches: list[NextBatch], cost: Callable[[list[NextBatch]], int], step_tokens: int,
                     fits: Callable[[list[NextBatch]], bool]) -> list[str]:
        """The jobs (a non-empty subset of `batches`) whose micro-batches form the next step. `cost` gives a
        set's tokens in the trainer's layout (padding included), which may not exceed `step_tokens` (a
        single job always may); `fits` says whether a set stays within the trainer's memory budget."""


class Admission:
    """Memory and load bookkeeping while a policy plans: what each trainer holds, its queued step tokens,
    and where a job goes. A job is never placed past its trainer's budget."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot
        self.used = {t.id: memory_in_use(t, snapshot.on_trainer(t.id)) for t in snapshot.trainers}
        self.releasing = {t.id: sum(j.memory_bytes or 0 for j in snapshot.on_trainer(t.id) if j.preempting)
                          for t in snapshot.trainers}
        self.count = {t.id: len(snapshot.on_trainer(t.id)) for t in snapshot.trainers}
        self.node_count: dict[str, int] = {}   # running jobs on each node with a job_slots limit
        for t in snapshot.trainers:
            if t.node in snapshot.job_slots:
                self.node_count[t.node] = self.node_count.get(t.node, 0) + self.count[t.id]
        # queued step tokens: the remaining work of the jobs that stay on each trainer
        self.load = {t.id: sum(j.remaining_tokens for j in snapshot.on_trainer(t.id) if not j.preempting)
                     for t in snapshot.trainers}
        for job in snapshot.jobs:   # a job on its way to another trainer holds its room there already
            if job.moving_to in self.used and job.state == "running":
                self.reserve(job.moving_to, job)
        self.user_running: dict[str | None, int] = {}   # each user's running jobs, those placed this round too
        for job in snapshot.jobs:
            if job.state == "running":
                self.user_running[job.user] = self.user_running.get(job.user, 0) + 1

    def candidates(self, job: JobView) -> list[TrainerView]:
        return [t for t in self.snapshot.trainers if compatible(job, t)]

    def free(self, trainer: TrainerView) -> int:
        return trainer.memory_budget_bytes - self.used[trainer.id]

    def has_slot(self, trainer: TrainerView) -> bool:
        return (trainer.max_jobs is None or self.count[trainer.id] < trainer.max_jobs) and self.host_room(trainer)

    def host_room(self, trainer: TrainerView) -> bool:
        """Whether the trainer's node may take another running job (its job actor's process)."""
        limit = self.snapshot.job_slots.get(trainer.node) if trainer.node is not None else None
        return limit is None or self.node_count.get(trainer.node, 0) < limit

    def fits(self, trainer: TrainerView, job: JobView) -> bool:
        return self.has_slot(trainer) and self.free(trainer) >= (job.memory_bytes or 0)

    def order(self, trainer: TrainerView) -> tuple:
        """Least queued step tokens first, then most free memory, then trainer id."""
        return (self.load[trainer.id], -self.free(trainer), trainer.id)

    def place(self, job: JobView) -> Start | Wait:
        """Start the job on the least-loaded compatible trainer where it fits (`order`), or say why it waits."""
        candidates = self.candidates(job)
        if not candidates:
            return Wait(job.id, no_trainer_reason(job, self.snapshot.trainers), "no_trainer")
        quota = self.quota_reason(job)
        if quota is not None:
            return Wait(job.id, quota, "quota")
        need = job.memory_bytes or 0
        open_trainers = [t for t in candidates if self.has_slot(t)]
        if not open_trainers:
            if not any(self.host_room(t) for t in candidates):
                nodes = sorted({t.node for t in candidates if t.node is not None})
                return Wait(job.id, "waiting for host memory: " + ", ".join(
                    f"node {node[:12]} runs {self.snapshot.job_slots[node]} jobs, each with a process of its own "
                    "(job_processes_per_node)" for node in nodes), "host")
            return Wait(job.id, "waiting for a free slot: " + ", ".join(f"{t.id} runs {t.max_jobs} jobs (max_jobs)"
                                                                        for t in candidates if self.host_room(t)),
                        "slots")
        fitting = [t for t in open_trainers if self.free(t) >= need]
        if not fitting:
            free = ", ".join(f"{t.id}: {self.free(t) / 2**20:.0f} MiB free" for t in open_trainers)
            return Wait(job.id, f"waiting for memory: needs {need / 2**20:.0f} MiB ({free})", "memory")
        trainer = min(fitting, key=self.order)
        self.reserve(trainer.id, job)
        return Start(job.id, trainer.id)

    def quota_reason(self, job: JobView) -> str | None:
        """Why the job's user may not start another job now (None: they may)."""
        standing = self.snapshot.users.get(job.user)
        if standing is None:
            return None
        if standing.max_running is not None and self.user_running.get(job.user, 0) >= standing.max_running:
            return f"waiting for a job of {job.user} to end: their quota is {standing.max_running} running at once"
        if standing.out_of_tokens:
            return (f"waiting for {job.user}'s daily token quota ({standing.tokens_per_day}) to free up: "
                    f"{standing.tokens_today:.0f} trained over the last 24 hours")
        return None

    def reserve(self, trainer_id: str, job: JobView) -> None:
        """Count `job` on `trainer_id` from now on in this round (memory, slot and load)."""
        self.used[trainer_id] += job.memory_bytes or 0
        self.count[trainer_id] += 1
        self.load[trainer_id] += job.remaining_tokens
        self._count_node(trainer_id, 1)
        if job.state == "queued":
            self.user_running[job.user] = self.user_running.get(job.user, 0) + 1

    def hold(self, trainer_id: str, memory_bytes: int, user: str | None) -> None:
        """Count a job the snapshot does not show running on `trainer_id` (one started there since it was taken)."""
        self.used[trainer_id] += memory_bytes
        self.count[trainer_id] += 1
        self._count_node(trainer_id, 1)
        self.user_running[user] = self.user_running.get(user, 0) + 1

    def drop(self, trainer_id: str, memory_bytes: int, user: str | None) -> None:
        """Undo the count of a job the snapshot shows running on `trainer_id` that has left it since (ended, paused,
        preempted): its memory, slot and user's running job are free again (`hold`'s opposite)."""
        self.used[trainer_id] -= memory_bytes
        self.count[trainer_id] -= 1
        self._count_node(trainer_id, -1)
        self.user_running[user] = self.user_running.get(user, 0) - 1

    def unreserve(self, trainer_id: str, job: JobView) -> None:
        """Undo `reserve` (e.g. a `place` the policy decided against)."""
        self.used[trainer_id] -= job.memory_bytes or 0
        self.count[trainer_id] -= 1
        self.load[trainer_id] -= job.remaining_tokens
        self._count_node(trainer_id, -1)
        if job.state == "queued":
            self.user_running[job.user] = self.user_running.get(job.user, 0) - 1

    def _count_node(self, trainer_id: str, change: int) -> None:
        node = next((t.node for t in self.snapshot.trainers if t.id == trainer_id), None)
        if node in self.snapshot.job_slots:
            self.node_count[node] = self.node_count.get(node, 0) + change

    def release(self, job: JobView) -> None:
        if job.trainer in self.used:
            self.used[job.trainer] -= job.memory_bytes or 0
            self.count[job.trainer] -= 1
            self._count_node(job.trainer, -1)
            if not job.preempting:
                self.load[job.trainer] -= job.remaining_tokens


def compatible(job: JobView, trainer: TrainerView) -> bool:
    return job.base_model == trainer.base_model and job.quantization == trainer.quantization


def memory_in_use(trainer: TrainerView, jobs: list[JobView]) -> int:
    """What a trainer holds with these jobs on it: base, a step's memory, each job's own memory."""
    return trainer.base_bytes + trainer.step_memory_bytes + sum(j.memory_bytes or 0 for j in jobs)


def no_trainer_reason(job: JobView, trainers: tuple[TrainerView, ...]) -> str:
    held = sorted({f"{t.base_model} ({t.quantization})" for t in trainers}) or ["none"]
    return (f"no trainer holds base model '{job.base_model}' with quantization '{job.quantization}' "
            f"(trainers hold: {', '.join(held)}); start a trainer for it or resubmit with one of those")
