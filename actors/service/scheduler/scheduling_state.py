"""The scheduler's memory of each job beside the job table: one `SchedulingState` per job id, so that
forgetting a job is one `del`.

A record holds the job's parsed submission, its adapter's memory, a preemption or move under way, how often
its trainer gave it back, why it waited in the last round. Nothing here is persisted: after a restart the
records are rebuilt as the scheduler meets the jobs again (a move or preemption under way is then lost, as
the job was queued again)."""

from __future__ import annotations

from dataclasses import dataclass

from actors.spec.job_submission import JobSubmission


@dataclass
class SchedulingState:
    """One job's scheduling memory (every field has the value of a job the scheduler knows nothing of)."""

    submission: JobSubmission | None = None   # parsed once, not on every scheduling tick
    memory: int | None = None                 # its adapter's memory on a trainer of its base
    preempting: str | None = None             # why it is pausing: its `paused` event means "queue again"
    moving_to: str | None = None              # the trainer it moves to (pausing, then pinned there)
    moved_at: float | None = None             # when it was last moved (the policy's hysteresis)
    predicted_remaining: int | None = None    # steps a stop rule predicts are left
    retries: int = 0                          # times its trainer gave it back (job actor lost or hung)
    replace_job_actor: bool = False           # its job actor must not be reused (lost or hung)
    wait_cause: str | None = None             # why it waited in the last decision round
    table_reason: str | None = None           # its reason in the table when the last round began
    parked_by_policy: bool = False            # parked since the policy last decided with queued jobs


class SchedulingStates(dict[str, SchedulingState]):
    """job id -> `SchedulingState`; `of` makes a record on first use, `get` (a dict's) only reads."""

    def of(self, job_id: str) -> SchedulingState:
        state = self.get(job_id)
        if state is None:
            state = self[job_id] = SchedulingState()
        return state

    def forget(self, job_id: str) -> None:
        self.pop(job_id, None)

    def parked_by_policy(self) -> list[str]:
        """The jobs parked for the policy's exceptions, sorted."""
        return sorted(job_id for job_id, state in self.items() if state.parked_by_policy)

    def clear_parked(self) -> None:
        for state in self.values():
            state.parked_by_policy = False

    def needs_new_job_actor(self, job_id: str) -> bool:
        state = self.get(job_id)
        return state is not None and state.replace_job_actor

    def job_actor_replaced(self, job_id: str) -> None:
        state = self.get(job_id)
        if state is not None:
            state.replace_job_actor = False
