"""The scheduler's core: decision rounds and the user's requests over the job table, with submissions,
trainer events and the policy each handled by a part of its own.

The parts: entering jobs (`submissions.py`), booking what trainers report (`event_booking.py`), the policy
contained (`policy_guard.py`), and one `SchedulingState` per job for what the scheduler remembers beside the table
(`scheduling_state.py`); `SchedulerCore` holds them together for the scheduler actor and the in-process run.

Everything here is synchronous and Ray-free; the actor shell calls it from its loop and carries the
decisions out (starting job actors, assigning and stopping jobs on trainers).

One job never stops the service: a submission is checked whole before anything is written (a batch is all or
none); a policy or estimator that raises on one job parks that job and the others are scheduled; a policy that
raises on everything, or overruns its time limit (`policy_timeout_s`) round after round, is replaced by FIFO.

A `Move` is carried out in two rounds: the job is paused at its next step boundary with a checkpoint (like a
preemption, reason "moving to ..."); when its `paused` event lands it is queued, pinned to the target, and
the next round starts it there (before the policy is asked), if the target is still there and still
holds it; otherwise the pin is dropped and the policy places it like any queued job. Trainer events
are applied inside the caller's transaction, so that a batch the table could not take (another process
holds the file) is retried whole, never half-applied or dropped."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from actors.service.events.event_booking import EventBooking
from actors.service.outputs.earlier_outputs import missing_checkpoint, raise_trains_nothing_from
from actors.service.scheduler.chained_jobs import settle
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.interactive_jobs import InteractiveJobs
from actors.service.scheduler.job_fit import job_adapter_bytes, never_fits, trainer_view
from actors.service.scheduler.moved_jobs import start_moved
from actors.service.scheduler.policy_answer import StartCheck, leave_reasons, move_refusal, refuse_start, wait_taken
from actors.service.scheduler.policy_clock import Outside
from actors.service.scheduler.policy_guard import POLICY_TIMEOUT_S, PolicyGuard, park
from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.scheduler.submissions import QuotaExceeded, SubmissionConflict, SubmissionError, Submissions
from actors.service.scheduler.user_standing import UserStanding
from actors.service.table.job_record import unreported_resume_point
from actors.service.table.job_table import ACTIVE_STATES, TERMINAL_STATES, JobRecord, JobTable, JobTableBusy
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from actors.spec.job_submission import JobSubmission
from actors.spec.saved_adapter import JobAdapter
from actors.spec.submission_changes import BudgetRefused, budget_raise, raise_trains_nothing
from actors.storage.storage_uri import StorageURI
from policies.base import (
    JobView,
    Move,
    Policy,
    Preempt,
    Snapshot,
    Start,
    TrainerView,
    UserShare,
    Wait,
)

log = logging.getLogger(__name__)

RESTARTABLE_STATES = ("paused", "failed", "cancelled")

# SubmissionError, QuotaExceeded and SubmissionConflict are raised by `submit_many`: importable from here with it
__all__ = ["QuotaExceeded", "SchedulerCore", "StopRequest", "SubmissionConflict", "SubmissionError"]


@dataclass(frozen=True)
class StopRequest:
    """Ask `trainer` to end `job` at its next step boundary as `kind` (cancelled / paused)."""

    job: str
    trainer: str
    kind: str
    reason: str


class SchedulerCore:
    def __init__(self, table: JobTable, policy: Policy, state_dir: Path,
                 on_decision: Callable[[str, str, str], None] | None = None, *,
                 trainers: Sequence[TrainerConfig] = (), output_root: Path | str | None = None,
                 data_roots: Sequence[str] | None = None, fair_share_window_s: float = 3600.0,
                 user_functions: Sequence[str] = (), policy_timeout_s: float = POLICY_TIMEOUT_S):
        """`on_decision(kind, job, reason)` hears preemptions and each new reason a queued job waits for
        (`wait_memory`, `wait_slots`, ...: once per job and cause, not every round). `trainers`: the
        service's trainer kinds (a submission whose micro-batch no trainer of its base can step is
        refused). `output_root`: where submitted jobs may write, a path or a storage URI (None: anywhere the
        service can). `data_roots`: where jobs may read (actors/service/scheduler/data_roots.py). `user_functions`:
        the functions users' jobs may call besides the built-in ones. `policy_timeout_s`: policy_clock.py."""
        self.table = table
        self.on_decision = on_decision
        self.scheduling = SchedulingStates()
        self.statuses: dict[str, TrainerStatus] = {}   # the trainers' last reported status
        self.submissions = Submissions(table, state_dir, trainers=trainers, output_root=output_root,
                                       statuses=lambda: self.statuses.values(), data_roots=data_roots,
                                       user_functions=user_functions)
        self.standings = UserStanding(self.submissions.users, table, fair_share_window_s)
        self.booking = EventBooking(table, self.scheduling)
        self.interactive = InteractiveJobs(table, state_dir, self.scheduling, lambda: (self.node_of, self.job_slots))
        self.guard = PolicyGuard(policy, table, self.scheduling, policy_timeout_s)
        # where each trainer runs and how many running jobs each node holds (Snapshot.job_slots): set by the
        # scheduler actor from its fleet and the nodes' memory; none known, no host limit
        self.node_of: Callable[[str], str | None] = lambda trainer_id: None
        self.job_slots: dict[str, int] = {}
        # why the jobs of a (base, quantization) whose trainers failed or wait for a node wait (TrainerFleet)
        self.trainer_waits: dict[tuple[str, str], str] = {}

    @property
    def policy(self) -> Policy:
        """The policy deciding now (FIFO once the configured one was replaced)."""
        return self.guard.policy

    @property
    def policy_error(self) -> str | None:
        """Why the configured policy was replaced by FIFO, or None."""
        return self.guard.error

    @property
    def output_root(self) -> Path | StorageURI | None:
        return self.submissions.output_root

    # -- submissions and trainer reports (see their modules) ------------------------------------------------
    def submit(self, submission: JobSubmission) -> JobRecord:
        return self.submit_many([submission])[0]

    def submit_many(self, submissions: list[JobSubmission], job_ids: list[str] | None = None, *,
                    starts_over: bool = False) -> list[JobRecord]:
        """`Submissions.submit_many`: all or none, checked first, entered in one transaction."""
        return self.submissions.submit_many(submissions, job_ids, starts_over=starts_over)

    def apply_event(self, trainer_id: str, event: TrainerEvent) -> None:
        """`EventBooking.apply_event`: called inside the caller's transaction."""
        self.booking.apply_event(trainer_id, event)

    def start_failed(self, job_id: str, reason: str) -> None:
        self.booking.start_failed(job_id, reason)

    def start_lost(self, job_id: str, reason: str) -> None:
        self.booking.start_lost(job_id, reason)

    def trainer_lost(self, trainer_id: str, error: str) -> list[str]:
        return self.booking.trainer_lost(trainer_id, error)

    def recover(self, resume: bool = True) -> list[str]:
        """After a (re)start: jobs that were running are queued again (they resume from their checkpoints),
        or, with `resume=False`, they and the queued ones are paused until someone resumes them (`aspen run`
        decides per job whether its spec still matches)."""
        recovered = []
        for record in self.table.all(ACTIVE_STATES):
            if self.is_interactive(record.id):   # its session's calls were on the trainers that went
                self.interactive.close(record.id, "failed", "the service restarted, which ends interactive models; "
                                       "its saved states remain (create_training_client_from_state resumes one)")
        for record in self.table.all(("running",) if resume else ("running", "queued")):
            step = unreported_resume_point(record.checkpoint_step)   # its trainer went with the service
            if resume:
                self.table.set_state(record.id, "queued", f"the service restarted; resumes from {step}", trainer=None)
            else:
                self.table.set_state(record.id, "paused", "the service restarted; held until resumed, then resumes "
                                     f"from {step}", trainer=None)
            recovered.append(record.id)
        return recovered

    # -- user requests ----------------------------------------------------------------------------------
    def cancel(self, key: str, reason: str = "cancelled by the user") -> tuple[JobRecord, StopRequest | None]:
        record = self.table.find(key)
        if record.state in TERMINAL_STATES:
            raise ValueError(f"job {record.id} has already ended ({record.state}: {record.reason})")
        if record.state == "running" and record.trainer:
            return record, StopRequest(job=record.id, trainer=record.trainer, kind="cancelled", reason=reason)
        return self.table.set_state(record.id, "cancelled", reason, trainer=None), None

    def is_interactive(self, job_id: str) -> bool:
        """Whether the job is an interactive model (the Tinker API's), which the policy never places."""
        return self._submission(job_id).job.method == "interactive"

    def pause(self, key: str, reason: str = "paused by the user") -> tuple[JobRecord, StopRequest | None]:
        record = self.table.find(key)
        if self.is_interactive(record.id):
            raise ValueError(f"job {record.id} is an interactive model, run by its user's own loop: it cannot be "
                             "paused (cancel ends it, keeping its saved states)")
        if record.state == "running" and record.trainer:
            return record, StopRequest(job=record.id, trainer=record.trainer, kind="paused", reason=reason)
        if record.state == "queued":
            return self.table.set_state(record.id, "paused", reason), None
        raise ValueError(f"job {record.id} is {record.state}; only queued or running jobs can be paused")

    def resume(self, key: str, reason: str = "resumed by the user") -> JobRecord:
        """Queue a paused, failed or cancelled job again: it resumes from its last checkpoint."""
        record = self.table.find(key)
        if self.is_interactive(record.id):
            raise ValueError(f"job {record.id} is an interactive model, which ends with its session: its user starts "
                             "a new one from a saved state (create_training_client_from_state)")
        if record.state not in RESTARTABLE_STATES:
            raise ValueError(f"job {record.id} is {record.state}; only paused, failed or cancelled jobs can be "
                             "resumed")
        gone = missing_checkpoint(record.output_dir, record.checkpoint_step)
        if gone is not None:
            raise ValueError(f"job {record.id}: {gone}, so it would train again from step 0, not on from step "
                             f"{record.checkpoint_step}; put the checkpoint back and resume it again, or submit it as "
                             "a new job to train it from the start")
        self.submissions.check_requeue(self.table.submission(record.id))   # its user's quota and data roots now
        if record.id in self.scheduling:
            self.scheduling[record.id].retries = 0
        step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
        return self.table.set_state(record.id, "queued", f"{reason}; resumes from {step}", trainer=None)

    def extend(self, key: str, submission: JobSubmission, reason: str = "its budget raised") -> JobRecord:
        """Raise an ended or paused job's `max_steps`, `epochs` or both (`submission`: its spec with only those
        raised) and queue it again: it continues from its last checkpoint to the new budget (orchestrator/run_plan.py
        says how its schedule and data go on)."""
        record = self.table.find(key)
        if self.is_interactive(record.id):
            raise ValueError(f"job {record.id} is an interactive model: its user's loop decides its steps")
        if record.state not in (*RESTARTABLE_STATES, "completed", "stopped_early"):
            raise ValueError(f"job {record.id} is {record.state}; only an ended or paused job's budget can be raised")
        earlier = self.table.submission(record.id)
        kept = submission.model_copy(update={"user": earlier.user, "output_dir": earlier.output_dir})
        try:
            raised = budget_raise(earlier, kept)
        except BudgetRefused as error:
            raise ValueError(f"job {record.id}: {error}") from None
        if raised is None:
            raise ValueError(f"job {record.id}: only a larger max_steps (now {earlier.job.max_steps}) or epochs (now "
                             f"{earlier.job.epochs}) may be given to continue it; for other changes start a new job")
        nothing = (raise_trains_nothing(raised, record.total_steps)
                   or raise_trains_nothing_from(raised, record.output_dir))
        if nothing is not None:
            raise ValueError(f"job {record.id} is {nothing}")
        gone = missing_checkpoint(record.output_dir, record.checkpoint_step)
        if gone is not None:
            raise ValueError(f"job {record.id}: {gone}, so it would train again from step 0, not on from step "
                             f"{record.checkpoint_step}; put the checkpoint back and extend it again, or submit it as "
                             "a new job to train it from the start")
        self.submissions.check_requeue(kept)   # its user's quota and data roots now
        self.table.set_submission(record.id, kept)
        # its work left the new budget's (until its start plans it), not none; its stop rule's prediction gone with
        # the old budget
        self.table.update(record.id, total_steps=raised.planned_total(record.total_steps))
        self.scheduling.of(record.id).submission = self.scheduling.of(record.id).predicted_remaining = None
        if record.id in self.scheduling:
            self.scheduling[record.id].retries = 0
        step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
        return self.table.set_state(record.id, "queued", f"{reason}: {raised.describe()}; continues from {step}",
                                    trainer=None)

    def delete(self, key: str) -> None:
        """Forget a job that is not running (its files are left as they are)."""
        record = self.table.find(key)
        if record.state == "running":
            raise ValueError(f"job {record.id} is running; cancel it first")
        self.table.delete(record.id)
        self.scheduling.forget(record.id)

    # -- decisions --------------------------------------------------------------------------------------
    def snapshot(self, trainers: list[TrainerStatus]) -> Snapshot:
        views = tuple(replace(trainer_view(t), node=self.node_of(t.trainer_id)) for t in trainers)
        jobs = []
        for record in self.table.all(ACTIVE_STATES):
            if record.state != "running" and self.is_interactive(record.id):
                continue   # placed by its front (actors/service/scheduler/interactive_jobs.py), never by the policy
            self.scheduling.of(record.id).table_reason = record.reason
            if record.state == "queued" and not self._may_start(record):
                continue   # it waits for another job's adapter (actors/service/scheduler/chained_jobs.py)
            try:
                view = self._job_view(record, views)
            except Exception as error:  # an estimator failing on one job parks that job alone
                log.exception("scheduler: estimating job %s failed", record.id)
                park(self.table, record, f"the service could not estimate its work or memory: {error!r}")
                continue
            if view is not None:
                jobs.append(view)
        return Snapshot(time=time.time(), trainers=views, jobs=tuple(jobs), job_slots=dict(self.job_slots),
                        users=self.standing())

    def _may_start(self, record: JobRecord) -> bool:
        """Whether a queued job may be placed: not while the job whose adapter it starts from runs (its reason says
        so); one whose source ended without an adapter fails."""
        submission = self._submission(record.id)
        if not isinstance(submission.job.init_adapter, JobAdapter):
            return True
        settled = settle(self.table, record, submission)
        if settled.failed is not None:
            self.table.set_state(record.id, "failed", f"could not start: {settled.failed}", trainer=None)
            return False
        if settled.waiting is not None:
            if record.reason != settled.waiting:
                self.table.set_reason(record.id, settled.waiting)
            return False
        self.scheduling.of(record.id).submission = settled.submission
        return True

    def standing(self) -> dict[str | None, UserShare]:
        """Each user's share, trained tokens over the fair-share window and quotas (user_standing.py)."""
        return self.standings.current()

    def plan(self, trainers: list[TrainerStatus],
             unlocked: Outside = contextlib.nullcontext) -> list[Start | Preempt | Move]:
        """Start moved jobs on their targets; ask the policy; record why waiting jobs wait; mark started
        jobs running (so that the next tick does not start them twice) and return what the actor must
        carry out (a `Move`: pause the job on its trainer, like a `Preempt`).

        The policy decides on the round's snapshot inside `unlocked()` (the scheduler loop's: the service's lock
        released, where a slow policy held every user's call up to `policy_timeout_s`); called outside a table
        transaction, the snapshot and the decisions are each written in one of their own, the decisions checked
        against the table then: a job cancelled, paused or deleted meanwhile is left as it is."""
        with self.table.transaction():
            self.statuses = {t.trainer_id: t for t in trainers}
            actions: list[Start | Preempt | Move] = start_moved(self.table, self.scheduling, trainers)
            snapshot = self.snapshot(trainers)
        decisions = self.guard.decide(snapshot, unlocked)
        try:
            with self.table.transaction():
                return actions + self._apply(snapshot, decisions)
        except JobTableBusy as error:   # the moved jobs' starts are written: carried out; the decisions next round
            log.warning("scheduler: %s; the policy's decisions of this round were not written, the next round "
                        "decides again", error)
            return actions

    def _apply(self, snapshot: Snapshot, decisions: list) -> list[Start | Preempt | Move]:
        """The policy's decisions written and returned to be carried out, each on a job still as the snapshot saw
        it (its state and trainer in the table now), a Start also on its trainer as it is now (policy_answer.py)."""
        actions: list[Start | Preempt | Move] = []
        records = self.table.all(ACTIVE_STATES)
        now = {r.id: (r.state, r.trainer) for r in records}
        known = {j.id: j for j in snapshot.jobs}
        on_trainer = {t.id: set(t.jobs) for t in snapshot.trainers}
        starts = StartCheck(snapshot, records, lambda job_id: self.scheduling.of(job_id).memory or 0)
        for decision in decisions:
            job = known.get(decision.job)
            if job is None:
                self.guard.unknown_job(decision)
                continue
            if now.get(job.id) != (job.state, job.trainer):   # cancelled, paused, ended or deleted while it decided
                log.info("scheduler: %r not done: job %s changed while the policy decided (now %s)", decision, job.id,
                         now.get(job.id, ("gone",))[0])
                continue
            state = self.scheduling.of(job.id)
            if isinstance(decision, Wait):
                if decision.cause == "no_trainer":   # its base's trainers are there, but failed or wait for a node
                    reason = self.trainer_waits.get((job.base_model, job.quantization), decision.reason)
                    decision = replace(decision, reason=reason)
                if job.state == "queued":
                    if state.table_reason != decision.reason:   # most waits repeat: no write then
                        self.table.set_reason(job.id, decision.reason)
                    if state.wait_cause != decision.cause:
                        self.table.after_commit(lambda job=job, decision=decision: self._waits(job.id, decision))
            elif isinstance(decision, Start):
                if job.state != "queued":
                    self.guard.cannot_start(job, decision)
                    continue
                if (refused := starts.refusal(job, decision.trainer)) is not None:
                    refuse_start(self.table, self.policy.name, job, decision, refused, self.guard.warn)
                    continue
                if (taken := starts.taken_since(job, decision.trainer)) is not None:   # memory taken meanwhile
                    wait_taken(self.table, self.policy.name, job, decision, taken)
                    continue
                starts.count(job, decision.trainer)
                self.table.set_state(job.id, "running", f"starting on {decision.trainer}", trainer=decision.trainer)
                self.table.after_commit(lambda state=state: setattr(state, "wait_cause", None))
                actions.append(decision)
            elif isinstance(decision, (Preempt, Move)) and self.is_interactive(job.id):
                self.guard.stays_interactive(job, decision)
            elif isinstance(decision, Preempt):
                if job.state == "running" and job.trainer:
                    self.table.after_commit(lambda job=job, decision=decision: self._preempting(job.id, decision))
                    actions.append(decision)
                else:   # once dropped without a word: the policy's author saw nothing of it
                    self.guard.not_running(job, decision)
            elif isinstance(decision, Move):
                if (refused := move_refusal(job, decision, on_trainer)) is not None:
                    self.guard.cannot_move(job, decision, refused)
                    continue
                self.table.set_reason(job.id, f"{decision.reason}; pausing on {job.trainer} at its next step")
                self.table.after_commit(lambda job=job, decision=decision, now=snapshot.time:
                                        self._moving(job.id, decision, now))
                actions.append(decision)
        leave_reasons(self.table, self.policy.name, snapshot, decisions)
        return actions

    def _moving(self, job_id: str, decision: Move, now: float) -> None:
        state = self.scheduling.of(job_id)
        state.preempting = f"moving to {decision.trainer}: {decision.reason}"
        state.moving_to = decision.trainer
        state.moved_at = now
        self._decided("move", job_id, decision.reason)

    def _waits(self, job_id: str, decision: Wait) -> None:
        self.scheduling.of(job_id).wait_cause = decision.cause
        self._decided(f"wait_{decision.cause}", job_id, decision.reason)

    def _preempting(self, job_id: str, decision: Preempt) -> None:
        self.scheduling.of(job_id).preempting = f"preempted: {decision.reason}"
        self._decided("preempt", job_id, decision.reason)

    def _decided(self, kind: str, job_id: str, reason: str) -> None:
        if self.on_decision is not None:
            self.on_decision(kind, job_id, reason)

    def _submission(self, job_id: str) -> JobSubmission:
        state = self.scheduling.of(job_id)
        if state.submission is None:
            state.submission = self.table.submission(job_id)
        return state.submission

    def _job_view(self, record: JobRecord, trainers: tuple[TrainerView, ...]) -> JobView | None:
        """The policy's view of a job; None for a job just failed (it can never run)."""
        spec = self._submission(record.id)
        state = self.scheduling.of(record.id)
        same_base = [t for t in trainers if t.base_model == record.base_model and t.quantization == record.quantization]
        if state.memory is None and same_base:
            try:
                state.memory = job_adapter_bytes(spec.job.lora, same_base[0], reference=spec.job.reference_adapter,
                                                 keep_best=spec.job.keep_best is not None)
            except ValueError as error:   # target_modules that the base model does not have
                self.table.set_state(record.id, "failed", str(error), trainer=None)
                return None
        if record.state == "queued" and same_base:
            problem = never_fits(spec, state.memory, same_base)
            if problem:
                self.table.set_state(record.id, "failed", f"cannot run on any trainer: {problem}", trainer=None)
                return None
        if record.step and record.tokens:
            tokens_per_step = record.tokens / record.step
        else:   # not measured yet: half of max_seq_len per sequence (a preference pair is two)
            tokens_per_step = (spec.job.batch_size * spec.job.grad_accum * spec.job.max_seq_len / 2
                               * spec.job.sequences_per_example)
        total = record.total_steps if record.total_steps is not None else spec.job.max_steps
        moving_to = state.moving_to if record.state == "running" and record.trainer != state.moving_to else None
        return JobView(id=record.id, name=record.name, state=record.state, priority=record.priority,
                       submitted_at=record.submitted_at, base_model=record.base_model,
                       quantization=record.quantization, trainer=record.trainer, step=record.step,
                       total_steps=total, memory_bytes=state.memory, tokens_per_step=tokens_per_step,
                       predicted_remaining_steps=state.predicted_remaining, preempting=state.preempting is not None,
                       moving_to=moving_to, moved_at=state.moved_at, user=record.user)
