"""The scheduler actor's core: the job table, what trainers report, and the policy's decisions.

Everything here is synchronous and Ray-free; the actor shell calls it from its loop and carries the
decisions out (starting job actors, assigning and stopping jobs on trainers)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from actors.core.events import TrainerEvent, TrainerStatus
from actors.core.job_table import TERMINAL_STATES, JobRecord, JobTable
from actors.engine.spec import JobSubmission
from policies.base import Decision, JobView, Policy, Preempt, Snapshot, Start, TrainerView, Wait
from policies.memory import adapter_memory_bytes

log = logging.getLogger(__name__)

ACTIVE_STATES = ("queued", "running", "paused")


@dataclass(frozen=True)
class StopRequest:
    """Ask `trainer` to end `job` at its next step boundary as `kind` (cancelled / paused)."""

    job: str
    trainer: str
    kind: str
    reason: str


class SchedulerCore:
    def __init__(self, table: JobTable, policy: Policy, state_dir: Path,
                 on_decision: Callable[[str, str, str], None] | None = None):
        """`on_decision(kind, job, reason)` hears preemptions and each new reason a queued job waits for
        (`wait_memory`, `wait_slots`, ...: once per job and cause, not every round)."""
        self.table = table
        self.on_decision = on_decision
        self.wait_causes: dict[str, str] = {}     # job id -> why it waited in the last round
        self.policy = policy
        self.state_dir = Path(state_dir)
        self.memory: dict[str, int] = {}          # job id -> its adapter's memory on a trainer
        self.preempting: dict[str, str] = {}      # job id -> reason: its `paused` event means "queue again"
        self.predicted_remaining: dict[str, int] = {}   # job id -> steps a stop rule predicts are left
        self.submissions: dict[str, JobSubmission] = {}  # parsed once, not on every scheduling tick

    # -- submissions ------------------------------------------------------------------------------------
    def submit(self, submission: JobSubmission) -> JobRecord:
        return self.submit_many([submission])[0]

    def submit_many(self, submissions: list[JobSubmission]) -> list[JobRecord]:
        """Enter jobs in the table together (all or none): the next decision round sees them all, so jobs
        submitted together (a jobs file) start together and share their trainer's steps from the first."""
        planned: list[tuple[str, JobSubmission, Path]] = []
        taken = {Path(other.output_dir): other for other in self.table.all(ACTIVE_STATES)}
        for submission in submissions:
            name = submission.job.name
            job_id = f"{name[:56]}-{uuid.uuid4().hex[:6]}"
            output_dir = Path(submission.output_dir) if submission.output_dir else self.state_dir / "outputs" / job_id
            output_dir = output_dir.expanduser().resolve()
            if output_dir in taken:
                other = taken[output_dir]
                raise ValueError(f"job {other.id} ({other.state}) already writes to {output_dir}; give job "
                                 f"'{name}' another output_dir or wait for that job to end")
            if any(output_dir == planned_dir for _, _, planned_dir in planned):
                raise ValueError(f"two of the submitted jobs would write to {output_dir}; give job '{name}' "
                                 "another output_dir")
            planned.append((job_id, submission, output_dir))
        return [self.table.add(job_id, submission, output_dir) for job_id, submission, output_dir in planned]

    def recover(self) -> list[str]:
        """After a (re)start: jobs that were running are queued again; they resume from their checkpoints."""
        recovered = []
        for record in self.table.all(("running",)):
            step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
            self.table.set_state(record.id, "queued", f"the service restarted; resumes from {step}", trainer=None)
            recovered.append(record.id)
        return recovered

    # -- user requests ----------------------------------------------------------------------------------
    def cancel(self, key: str, reason: str = "cancelled by the user") -> tuple[JobRecord, StopRequest | None]:
        record = self.table.find(key)
        if record.state in TERMINAL_STATES:
            raise ValueError(f"job {record.id} has already ended ({record.state}: {record.reason})")
        if record.state == "running" and record.trainer:
            return record, StopRequest(record.id, record.trainer, "cancelled", reason)
        return self.table.set_state(record.id, "cancelled", reason, trainer=None), None

    def pause(self, key: str, reason: str = "paused by the user") -> tuple[JobRecord, StopRequest | None]:
        record = self.table.find(key)
        if record.state == "running" and record.trainer:
            return record, StopRequest(record.id, record.trainer, "paused", reason)
        if record.state == "queued":
            return self.table.set_state(record.id, "paused", reason), None
        raise ValueError(f"job {record.id} is {record.state}; only queued or running jobs can be paused")

    def resume(self, key: str) -> JobRecord:
        record = self.table.find(key)
        if record.state != "paused":
            raise ValueError(f"job {record.id} is {record.state}, not paused")
        return self.table.set_state(record.id, "queued", "resumed by the user")

    # -- trainer reports --------------------------------------------------------------------------------
    def apply_event(self, trainer_id: str, event: TrainerEvent) -> None:
        if event.kind == "step":   # the trainer's own step row: for metrics, not the job table
            return
        job_id, data = event.job_id, event.data
        try:
            record = self.table.get(job_id)
        except KeyError:
            log.warning("trainer %s reported on unknown job %s", trainer_id, job_id)
            return
        if record.state in TERMINAL_STATES:
            return
        kind = event.kind
        if kind == "started":
            resumed = data.get("resumed_from")
            columns = {}
            if resumed is not None:   # the checkpoint's history is the truth: steps after it are replayed
                self.table.forget_progress_after(job_id, resumed)
                for row in data.get("history", []):
                    self.table.add_progress(job_id, row)
                last = data["history"][-1] if data.get("history") else {}
                columns = {"tokens": data.get("tokens", 0), "loss": last.get("loss"), "checkpoint_step": resumed}
            reason = f"training on {trainer_id}" + (f", resumed from step {resumed}" if resumed else "")
            self.table.set_state(job_id, "running", reason, trainer=trainer_id, step=event.step,
                                 total_steps=data.get("total_steps"), **columns)
        elif kind == "progress":
            self.table.add_progress(job_id, data)
            self.table.update(job_id, step=event.step, loss=data.get("loss"), tokens=record.tokens + data["tokens"],
                              tokens_per_s=data.get("tokens_per_s"), total_steps=data.get("total_steps"))
        elif kind == "eval":
            self.table.add_eval(job_id, event.step, data["eval_loss"])
            self.table.update(job_id, eval_loss=data["eval_loss"])
        elif kind == "checkpoint":
            self.table.update(job_id, checkpoint_step=event.step)
        elif kind == "prediction":   # the job's stop rule expects it to end early: less work left
            self.predicted_remaining[job_id] = max(int(data["predicted_stop_step"]) - event.step, 0)
        elif kind == "paused" and job_id in self.preempting:
            self.table.set_state(job_id, "queued", self.preempting.pop(job_id), trainer=None,
                                 checkpoint_step=data.get("checkpoint_step"))
        else:  # completed, stopped_early, cancelled, paused, failed
            columns = {"trainer": None, "step": event.step}
            for key in ("adapter_dir", "eval_loss", "checkpoint_step"):
                if data.get(key) is not None:
                    columns[key] = data[key]
            if "eval_loss" in data:
                self.table.add_eval(job_id, event.step, data["eval_loss"])
            self.table.set_state(job_id, kind, data.get("reason", kind), **columns)

    def start_failed(self, job_id: str, reason: str) -> None:
        self.table.set_state(job_id, "failed", reason, trainer=None)

    def trainer_lost(self, trainer_id: str, error: str) -> list[str]:
        """A trainer died: its jobs are queued again and resume from their last checkpoints."""
        lost = []
        for record in self.table.all(("running",)):
            if record.trainer != trainer_id:
                continue
            step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
            self.table.set_state(record.id, "queued", f"trainer {trainer_id} was lost ({error}); resumes from {step}",
                                 trainer=None)
            lost.append(record.id)
        return lost

    # -- decisions --------------------------------------------------------------------------------------
    def snapshot(self, trainers: list[TrainerStatus]) -> Snapshot:
        views = tuple(self.trainer_view(t) for t in trainers)
        jobs = tuple(self._job_view(r, trainers) for r in self.table.all(ACTIVE_STATES))
        return Snapshot(time.time(), views, jobs)

    def plan(self, trainers: list[TrainerStatus]) -> list[Start | Preempt]:
        """Ask the policy; record why waiting jobs wait; mark started jobs running (so that the next
        tick does not start them twice) and return what the actor must carry out."""
        snapshot = self.snapshot(trainers)
        known = {j.id: j for j in snapshot.jobs}
        trainer_ids = {t.id for t in snapshot.trainers}
        actions: list[Start | Preempt] = []
        decisions: list[Decision] = self.policy.decide(snapshot)
        for decision in decisions:
            job = known.get(decision.job)
            if job is None:
                log.warning("policy %s decided on unknown job %s", self.policy.name, decision.job)
                continue
            if isinstance(decision, Wait):
                if job.state == "queued":
                    self.table.set_reason(job.id, decision.reason)
                    if self.wait_causes.get(job.id) != decision.cause:
                        self.wait_causes[job.id] = decision.cause
                        self._decided(f"wait_{decision.cause}", job.id, decision.reason)
            elif isinstance(decision, Start):
                if job.state != "queued" or decision.trainer not in trainer_ids:
                    log.warning("policy %s: cannot start %s (%s) on %s", self.policy.name, job.id, job.state,
                                decision.trainer)
                    continue
                self.table.set_state(job.id, "running", f"starting on {decision.trainer}", trainer=decision.trainer)
                self.wait_causes.pop(job.id, None)
                actions.append(decision)
            elif isinstance(decision, Preempt):
                if job.state == "running" and job.trainer:
                    self.preempting[job.id] = f"preempted: {decision.reason}"
                    self._decided("preempt", job.id, decision.reason)
                    actions.append(decision)
        return actions

    def _decided(self, kind: str, job_id: str, reason: str) -> None:
        if self.on_decision is not None:
            self.on_decision(kind, job_id, reason)

    def trainer_view(self, status: TrainerStatus) -> TrainerView:
        """The trainer's fixed memory and a worst-case step's memory, from its fitted memory model (a
        full step of `step_tokens` in sequences as long as the longest seen so far)."""
        shapes = tuple((name, i, o) for name, (i, o) in sorted(status.linear_shapes.items()))
        if status.memory_coefficients:
            constant, per_token, per_square, _ = status.memory_coefficients
            tokens = status.step_tokens or 4096
            step = per_token * tokens + per_square * tokens * min(tokens, max(status.longest_sequence, 1))
            fixed = max(int(constant), status.base_bytes)
            step_memory = max(int(step), 0)
        else:
            fixed, step_memory = status.base_bytes, status.activation_bytes_estimate
        return TrainerView(status.trainer_id, status.base_model, status.quantization, status.memory_budget_bytes,
                           fixed, step_memory, tuple(status.jobs), shapes, status.max_jobs)

    def _submission(self, job_id: str) -> JobSubmission:
        if job_id not in self.submissions:
            self.submissions[job_id] = self.table.submission(job_id)
        return self.submissions[job_id]

    def _job_view(self, record: JobRecord, trainers: list[TrainerStatus]) -> JobView:
        if record.id not in self.memory:
            same_base = [t for t in trainers if t.base_model == record.base_model]
            if same_base:
                lora = self._submission(record.id).job.lora
                try:
                    self.memory[record.id] = adapter_memory_bytes(lora, same_base[0].linear_shapes)
                except ValueError as error:   # target_modules that the base model does not have
                    self.table.set_state(record.id, "failed", str(error), trainer=None)
                    record = self.table.get(record.id)
        if record.step and record.tokens:
            tokens_per_step = record.tokens / record.step
        else:   # not measured yet: half of max_seq_len per sequence
            spec = self._submission(record.id).job
            tokens_per_step = spec.batch_size * spec.grad_accum * spec.max_seq_len / 2
        total = record.total_steps
        if total is None:
            spec = self._submission(record.id).job
            total = spec.max_steps
        return JobView(record.id, record.name, record.state, record.priority, record.submitted_at,
                       record.base_model, record.quantization, record.trainer, record.step, total,
                       self.memory.get(record.id), tokens_per_step, self.predicted_remaining.get(record.id),
                       record.id in self.preempting)
