"""The scheduler actor's core: the job table, what trainers report, and the policy's decisions.

Everything here is synchronous and Ray-free; the actor shell calls it from its loop and carries the
decisions out (starting job actors, assigning and stopping jobs on trainers).

One job never stops the service: a submission is checked whole before anything is written (a batch is
all or none); a policy or estimator that raises on one job parks that job with the reason and the others
are scheduled; a policy that raises on everything is replaced by FIFO with a logged error.

A `Move` is carried out in two rounds: the job is paused at its next step boundary with a checkpoint (like a
preemption, reason "moving to ..."); when its `paused` event lands it is queued, pinned to the target, and
the next round starts it there (before the policy is asked), if the target is still there and still
holds it; otherwise the pin is dropped and the policy places it like any queued job. Trainer events
are applied inside the caller's transaction, so that a batch the table could not take (another process
holds the file) is retried whole, never half-applied or dropped."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from actors.engine.lora import adapted_shapes
from actors.engine.spec import BASE_DEPENDENT_INITS, JobSubmission, LoraConfig, step_limit_problem
from actors.engine.storage import StorageURI, as_location, is_uri
from actors.service.config import TrainerConfig
from actors.service.job_table import TERMINAL_STATES, JobRecord, JobTable
from actors.service.trainer_reports import TrainerEvent, TrainerStatus
from policies.adapter_memory import adapter_memory_bytes
from policies.base import Decision, JobView, Move, Policy, Preempt, Snapshot, Start, TrainerView, Wait, memory_in_use
from policies.fifo import FifoPolicy

log = logging.getLogger(__name__)

ACTIVE_STATES = ("queued", "running", "paused")
RESTARTABLE_STATES = ("paused", "failed", "cancelled")
MAX_RETRIES = 3   # a job its trainer gave back (job actor lost or hung) is queued again this often, then fails
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,71}$")
POLICY_FAILURES_BEFORE_FIFO = 3   # jobs parked for a policy's exceptions before the policy itself is replaced


def job_adapter_bytes(lora: LoraConfig, trainer: TrainerView) -> int:
    """What a job's adapter costs on `trainer` (ValueError for target_modules its base does not have)."""
    shapes = adapted_shapes(lora.target_modules, {name: (i, o) for name, i, o in trainer.linear_shapes})
    return adapter_memory_bytes(lora.r, shapes, dora=lora.use_dora,
                                frozen_initial=lora.init_lora_weights.startswith(BASE_DEPENDENT_INITS))


@dataclass(frozen=True)
class StopRequest:
    """Ask `trainer` to end `job` at its next step boundary as `kind` (cancelled / paused)."""

    job: str
    trainer: str
    kind: str
    reason: str


class SubmissionError(ValueError):
    """A submission the service cannot take; nothing of its batch was entered."""


class SubmissionConflict(SubmissionError):
    """A submission that collides with jobs already in the table (their output folder, a job id); nothing of
    its batch was entered."""


class SchedulerCore:
    def __init__(self, table: JobTable, policy: Policy, state_dir: Path,
                 on_decision: Callable[[str, str, str], None] | None = None, *,
                 trainers: Sequence[TrainerConfig] = (), output_root: Path | str | None = None):
        """`on_decision(kind, job, reason)` hears preemptions and each new reason a queued job waits for
        (`wait_memory`, `wait_slots`, ...: once per job and cause, not every round). `trainers`: the
        service's trainer kinds (a submission whose micro-batch no trainer of its base can step is
        refused). `output_root`: where submitted jobs may write, a path or a storage URI (None: anywhere the
        service can)."""
        self.table = table
        self.on_decision = on_decision
        self.wait_causes: dict[str, str] = {}     # job id -> why it waited in the last round
        self.policy = policy
        self.policy_error: str | None = None      # why the configured policy was replaced by FIFO
        self.parked_by_policy: set[str] = set()   # jobs parked since the policy last decided with queued jobs
        self.state_dir = Path(state_dir)
        self.trainer_configs = list(trainers)
        self.output_root: Path | StorageURI | None = None
        if output_root is not None:
            root = as_location(output_root)
            self.output_root = root if isinstance(root, StorageURI) else root.expanduser().resolve()
        self.statuses: dict[str, TrainerStatus] = {}   # the trainers' last reported status
        self.memory: dict[str, int] = {}          # job id -> its adapter's memory on a trainer
        self.preempting: dict[str, str] = {}      # job id -> reason: its `paused` event means "queue again"
        self.moving: dict[str, str] = {}          # job id -> the trainer it moves to (pausing, then pinned there)
        self.moved_at: dict[str, float] = {}      # job id -> when it was last moved (the policy's hysteresis)
        self.predicted_remaining: dict[str, int] = {}   # job id -> steps a stop rule predicts are left
        self.submissions: dict[str, JobSubmission] = {}  # parsed once, not on every scheduling tick
        self.retries: dict[str, int] = {}         # job id -> times its trainer gave it back
        self.replace_job_actor: set[str] = set()   # jobs whose job actor must not be reused (lost or hung)
        self.reasons: dict[str, str] = {}          # job id -> its reason in the table when the round began

    # -- submissions ------------------------------------------------------------------------------------
    def submit(self, submission: JobSubmission) -> JobRecord:
        return self.submit_many([submission])[0]

    def submit_many(self, submissions: list[JobSubmission], job_ids: list[str] | None = None) -> list[JobRecord]:
        """Enter jobs in the table together, all or none: every submission is checked first (the error
        names which one and why), then all are written in one transaction. The next decision round sees
        them all, so jobs submitted together (a jobs file) start together. `job_ids`: ids the client
        chose, so that a request repeated after a lost answer returns the jobs it entered the first time."""
        if job_ids is not None:
            if len(job_ids) != len(submissions) or len(set(job_ids)) != len(job_ids):
                raise SubmissionError(f"{len(job_ids)} job ids for {len(submissions)} submissions (or repeated ids)")
            bad = [job_id for job_id in job_ids if not JOB_ID.match(job_id)]
            if bad:
                raise SubmissionError(f"job ids {bad} are not letters, digits, '-' and '_' (at most 72)")
            existing = self._already_entered(submissions, job_ids)
            if existing is not None:
                return existing
        planned: list[tuple[str, JobSubmission, Path]] = []
        problems: list[str] = []
        conflicts = 0   # problems that are collisions with jobs in the table (SubmissionConflict)
        for index, submission in enumerate(submissions):
            name = submission.job.name
            where = f"submission {index + 1} of {len(submissions)} (job '{name}')" if len(submissions) > 1 \
                else f"job '{name}'"
            job_id = job_ids[index] if job_ids is not None else f"{name[:56]}-{uuid.uuid4().hex[:6]}"
            try:
                output_dir = self._output_dir(submission, job_id)
                self._check_limits(submission)
                other = self.table.writing_to(output_dir, ACTIVE_STATES)
                if other is not None:
                    raise SubmissionConflict(f"job {other.id} ({other.state}) already writes to {output_dir}; give "
                                             "this job another output_dir or wait for that job to end")
                if any(output_dir == planned_dir for _, _, planned_dir in planned):
                    raise SubmissionError(f"two of the submitted jobs would write to {output_dir}; give this job "
                                          "another output_dir")
            except SubmissionError as error:
                problems.append(f"{where}: {error}")
                conflicts += isinstance(error, SubmissionConflict)
                continue
            planned.append((job_id, submission, output_dir))
        if problems:
            kind = SubmissionConflict if conflicts == len(problems) else SubmissionError
            raise kind(("nothing was submitted: " if len(submissions) > 1 else "") + "; ".join(problems))
        with self.table.transaction():
            return [self.table.add(job_id, submission, output_dir) for job_id, submission, output_dir in planned]

    def _already_entered(self, submissions: list[JobSubmission], job_ids: list[str]) -> list[JobRecord] | None:
        """The records of a batch entered before under these ids (a repeated request), or None if none was."""
        found = []
        for submission, job_id in zip(submissions, job_ids, strict=True):
            try:
                record = self.table.get(job_id)
            except KeyError:
                found.append(None)
                continue
            if self.table.submission(job_id) != submission:
                raise SubmissionConflict(f"job id {job_id} is taken by another job; submit again (the client "
                                         "picks new ids)")
            found.append(record)
        if all(r is None for r in found):
            return None
        if any(r is None for r in found):
            raise SubmissionConflict(f"part of this batch was entered before ({[r.id for r in found if r]}), part "
                                     "not; check `aspen status` before submitting again")
        return found

    def _output_dir(self, submission: JobSubmission, job_id: str) -> Path | StorageURI:
        """The job's folder: a resolved path, or a storage URI (its checkpoints and results are uploaded)."""
        root = self.output_root
        if isinstance(root, StorageURI):
            return self._uri_output_dir(submission, job_id, root)
        if submission.output_dir is None:
            return ((root or self.state_dir / "outputs") / job_id).resolve()
        if is_uri(submission.output_dir):
            if root is not None:
                raise SubmissionError(f"output_dir {submission.output_dir} is outside this service's output root "
                                      f"{root}; leave output_dir out (the job gets {root}/<job id>) or give a path "
                                      f"under {root}")
            return as_location(str(submission.output_dir))
        requested = Path(submission.output_dir).expanduser()
        if root is not None and not requested.is_absolute():
            requested = root / requested
        resolved = requested.resolve()
        if root is not None and not resolved.is_relative_to(root):
            raise SubmissionError(f"output_dir {resolved} is outside this service's output root {root}; jobs "
                                  "submitted to a shared service write only there: leave output_dir out (the job "
                                  f"gets {root}/<job id>) or give a path under {root}")
        return resolved

    @staticmethod
    def _uri_output_dir(submission: JobSubmission, job_id: str, root: StorageURI) -> StorageURI:
        """A job's folder under a storage-URI output root: `<root>/<job id>`, `<root>/<relative output_dir>`,
        or a URI under the root."""
        requested = submission.output_dir
        if requested is None:
            return root / job_id
        if is_uri(requested):
            uri = StorageURI(str(requested).rstrip("/"))
        elif Path(requested).is_absolute() or ".." in Path(requested).parts:
            raise SubmissionError(f"output_dir {requested} is a path on this machine, but this service's output root "
                                  f"is {root}: leave output_dir out (the job gets {root}/<job id>) or give a folder "
                                  f"name relative to it (or a URI under {root})")
        else:
            uri = root / Path(requested).as_posix()
        if not uri.is_relative_to(root) or "/../" in f"{uri}/":
            raise SubmissionError(f"output_dir {uri} is outside this service's output root {root}; leave output_dir "
                                  f"out (the job gets {root}/<job id>) or give a URI under {root}")
        return uri

    def _check_limits(self, submission: JobSubmission) -> None:
        """Refuse what no trainer of the job's base could ever run: a micro-batch beyond every trainer's
        step, or an adapter that does not fit any trainer's memory budget next to the base and a step."""
        same_base = [t for t in self.trainer_configs
                     if t.base_model == submission.base_model and t.quantization == submission.quantization]
        if same_base:
            # unnamed: submit_many's message names the job already
            problems = [step_limit_problem(submission.job, t.step_tokens, named=False) for t in same_base]
            if all(problems):
                raise SubmissionError(problems[0])
        views = [self.trainer_view(s) for s in self.statuses.values()
                 if s.base_model == submission.base_model and s.quantization == submission.quantization]
        if views:
            try:
                need = job_adapter_bytes(submission.job.lora, views[0])
            except ValueError as error:   # target_modules that the base model does not have
                raise SubmissionError(str(error)) from None
            problem = self._never_fits(submission, need, views)
            if problem:
                raise SubmissionError(problem)

    @staticmethod
    def _never_fits(submission: JobSubmission, need: int, views: list[TrainerView]) -> str | None:
        """Why a job whose adapter needs `need` bytes exceeds the memory budget of every trainer that holds
        its base even alone, or None."""
        if any(v.base_bytes + v.step_memory_bytes + need <= v.memory_budget_bytes for v in views):
            return None
        if any(v.empty_bytes is not None and v.empty_bytes + need <= v.memory_budget_bytes for v in views):
            return None   # it fits a trainer once that trainer's jobs are gone: it waits
        best = max(views, key=lambda v: v.memory_budget_bytes - v.base_bytes - v.step_memory_bytes)
        left = best.memory_budget_bytes - best.base_bytes - best.step_memory_bytes
        return (f"its adapter (lora.r={submission.job.lora.r}) needs {need / 2**20:.0f} MiB but {best.id}'s memory "
                f"budget ({best.memory_budget_bytes / 2**20:.0f} MiB) leaves {max(left, 0) / 2**20:.0f} MiB after the "
                "base model and a full step; lower lora.r or target fewer modules, or give the trainer a larger "
                "memory_budget_bytes or a smaller step_tokens")

    def recover(self, resume: bool = True) -> list[str]:
        """After a (re)start: jobs that were running are queued again (they resume from their checkpoints),
        or, with `resume=False`, they and the queued ones are paused until someone resumes them (`aspen run`
        decides per job whether its spec still matches)."""
        recovered = []
        for record in self.table.all(("running",) if resume else ("running", "queued")):
            step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
            if resume:
                self.table.set_state(record.id, "queued", f"the service restarted; resumes from {step}", trainer=None)
            else:
                self.table.set_state(record.id, "paused", f"the service restarted; held until resumed (from {step})",
                                     trainer=None)
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

    def resume(self, key: str, reason: str = "resumed by the user") -> JobRecord:
        """Queue a paused, failed or cancelled job again: it resumes from its last checkpoint."""
        record = self.table.find(key)
        if record.state not in RESTARTABLE_STATES:
            raise ValueError(f"job {record.id} is {record.state}; only paused, failed or cancelled jobs can be "
                             "resumed")
        self.retries.pop(record.id, None)
        step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
        return self.table.set_state(record.id, "queued", f"{reason}; resumes from {step}", trainer=None)

    def delete(self, key: str) -> None:
        """Forget a job that is not running (its files are left as they are)."""
        record = self.table.find(key)
        if record.state == "running":
            raise ValueError(f"job {record.id} is running; cancel it first")
        self.table.delete(record.id)
        for cache in (self.memory, self.predicted_remaining, self.submissions, self.retries, self.wait_causes,
                      self.moving, self.moved_at):
            cache.pop(record.id, None)

    # -- trainer reports --------------------------------------------------------------------------------
    def apply_event(self, trainer_id: str, event: TrainerEvent) -> None:
        """Book one trainer event in the table. Called inside the caller's transaction: changes to this
        object's own memory are made only once that transaction commits."""
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
        after = self.table.after_commit
        if kind == "started":
            resumed = data.get("resumed_from")
            columns = {}
            if resumed is not None:   # the checkpoint's history is the truth: steps after it are replayed
                self.table.forget_progress_after(job_id, resumed)
                for row in data.get("history", []):
                    self.table.add_progress(job_id, row)
                for step, eval_loss in data.get("evals", []):   # add_progress replaced those rows whole
                    self.table.add_eval(job_id, step, eval_loss)
                last = data["history"][-1] if data.get("history") else {}
                columns = {"tokens": data.get("tokens", 0), "loss": last.get("loss"), "checkpoint_step": resumed}
            reason = f"training on {trainer_id}" + (f", resumed from step {resumed}" if resumed else "")
            if data.get("checkpoint_note"):
                reason += f" ({data['checkpoint_note']})"
            self.table.set_state(job_id, "running", reason, trainer=trainer_id, step=event.step,
                                 total_steps=data.get("total_steps"), **columns)
        elif kind == "progress":
            self.table.add_progress(job_id, data)
            self.table.update(job_id, step=event.step, loss=data.get("loss"), tokens=record.tokens + data["tokens"],
                              tokens_per_s=data.get("tokens_per_s"), total_steps=data.get("total_steps"))
        elif kind == "eval":
            self.table.add_eval(job_id, event.step, data["eval_loss"])
            self.table.update(job_id, eval_loss=data["eval_loss"])
        elif kind == "checkpoint" and data.get("upload_error"):   # the uploaded checkpoint is an older one
            self.table.update(job_id, reason=f"training on {trainer_id}; {data['upload_error']}")
        elif kind == "checkpoint":
            self.table.update(job_id, checkpoint_step=event.step)
            if data.get("upload_recovered"):
                self.table.update(job_id, reason=f"training on {trainer_id}; its checkpoints upload again")
        elif kind == "prediction":   # the job's stop rule expects it to end early: less work left
            remaining = max(int(data["predicted_stop_step"]) - event.step, 0)
            after(lambda: self.predicted_remaining.__setitem__(job_id, remaining))
        elif kind == "paused" and data.get("retry"):
            self._given_back(job_id, data)
        elif kind == "paused" and job_id in self.preempting:
            reason = self.preempting[job_id]
            if job_id in self.moving:
                reason = f"{reason}; paused on {trainer_id}, resumes on {self.moving[job_id]}"
            self.table.set_state(job_id, "queued", reason, trainer=None, checkpoint_step=data.get("checkpoint_step"))
            after(lambda: self.preempting.pop(job_id, None))
        else:  # completed, stopped_early, cancelled, paused, failed
            columns = {"trainer": None, "step": event.step}
            for key in ("adapter_dir", "eval_loss", "checkpoint_step"):
                if data.get(key) is not None:
                    columns[key] = data[key]
            if "eval_loss" in data:
                self.table.add_eval(job_id, event.step, data["eval_loss"])
            self.table.set_state(job_id, kind, data.get("reason", kind), **columns)
            after(lambda: (self.preempting.pop(job_id, None), self.moving.pop(job_id, None)))

    def _given_back(self, job_id: str, data: dict) -> None:
        """The trainer gave a job back for a reason outside the job itself (its job actor died or hung):
        queue it again with a new job actor, from the checkpoint just written, at most MAX_RETRIES times."""
        attempt = self.retries.get(job_id, 0) + 1
        reason = data.get("reason", "given back by its trainer")
        checkpoint = data.get("checkpoint_step")
        if attempt > MAX_RETRIES:
            self.table.set_state(job_id, "failed", f"{reason}; this happened {attempt} times, giving up (resume it "
                                 "with `aspen resume` once the cause is fixed)", trainer=None,
                                 checkpoint_step=checkpoint)
        else:
            step = f"its checkpoint at step {checkpoint}" if checkpoint else "the start"
            self.table.set_state(job_id, "queued", f"{reason}; resumes from {step} with a new job actor (retry "
                                 f"{attempt} of {MAX_RETRIES})", trainer=None, checkpoint_step=checkpoint)

        def remember() -> None:
            self.retries[job_id] = attempt
            self.replace_job_actor.add(job_id)
            self.preempting.pop(job_id, None)
            self.moving.pop(job_id, None)   # a new job actor: the policy places it afresh
        self.table.after_commit(remember)

    def start_failed(self, job_id: str, reason: str) -> None:
        self.table.set_state(job_id, "failed", reason, trainer=None)

    def start_lost(self, job_id: str, reason: str) -> None:
        """A job's actor died before the job reached its trainer: start it again with a new one (bounded)."""
        self._given_back(job_id, {"reason": reason, "checkpoint_step": self.table.get(job_id).checkpoint_step})

    def trainer_lost(self, trainer_id: str, error: str) -> list[str]:
        """A trainer died (or its node left the cluster): its jobs are queued again and resume from their last
        checkpoints, each with a new job actor (the old one may have been on the same lost node)."""
        lost = []
        for record in self.table.all(("running",)):
            if record.trainer != trainer_id:
                continue
            step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
            self.table.set_state(record.id, "queued", f"trainer {trainer_id} was lost ({error}); resumes from {step}",
                                 trainer=None)
            # a job that was pausing to move on stays pinned to its target (started there next round)
            self.table.after_commit(lambda job_id=record.id: self.preempting.pop(job_id, None))
            lost.append(record.id)
        self.table.after_commit(lambda: self.replace_job_actor.update(lost))
        return lost

    # -- decisions --------------------------------------------------------------------------------------
    def snapshot(self, trainers: list[TrainerStatus]) -> Snapshot:
        views = tuple(self.trainer_view(t) for t in trainers)
        jobs = []
        self.reasons = {}
        for record in self.table.all(ACTIVE_STATES):
            self.reasons[record.id] = record.reason
            try:
                view = self._job_view(record, views)
            except Exception as error:  # an estimator failing on one job parks that job alone
                log.exception("scheduler: estimating job %s failed", record.id)
                self._park(record, f"the service could not estimate its work or memory: {error!r}")
                continue
            if view is not None:
                jobs.append(view)
        return Snapshot(time.time(), views, tuple(jobs))

    def plan(self, trainers: list[TrainerStatus]) -> list[Start | Preempt | Move]:
        """Start moved jobs on their targets; ask the policy; record why waiting jobs wait; mark started
        jobs running (so that the next tick does not start them twice) and return what the actor must
        carry out (a `Move`: pause the job on its trainer, like a `Preempt`)."""
        self.statuses = {t.trainer_id: t for t in trainers}
        actions: list[Start | Preempt | Move] = self._start_moved(trainers)
        snapshot = self.snapshot(trainers)
        known = {j.id: j for j in snapshot.jobs}
        trainer_ids = {t.id for t in snapshot.trainers}
        on_trainer = {t.id: set(t.jobs) for t in snapshot.trainers}
        for decision in self._decide(snapshot):
            job = known.get(decision.job)
            if job is None:
                log.warning("policy %s decided on unknown job %s", self.policy.name, decision.job)
                continue
            if isinstance(decision, Wait):
                if job.state == "queued":
                    if self.reasons.get(job.id) != decision.reason:   # most waits repeat: no write then
                        self.table.set_reason(job.id, decision.reason)
                    if self.wait_causes.get(job.id) != decision.cause:
                        self.table.after_commit(lambda job=job, decision=decision: self._waits(job.id, decision))
            elif isinstance(decision, Start):
                if job.state != "queued" or decision.trainer not in trainer_ids:
                    log.warning("policy %s: cannot start %s (%s) on %s", self.policy.name, job.id, job.state,
                                decision.trainer)
                    continue
                self.table.set_state(job.id, "running", f"starting on {decision.trainer}", trainer=decision.trainer)
                self.table.after_commit(lambda job=job: self.wait_causes.pop(job.id, None))
                actions.append(decision)
            elif isinstance(decision, Preempt):
                if job.state == "running" and job.trainer:
                    self.table.after_commit(lambda job=job, decision=decision: self._preempting(job.id, decision))
                    actions.append(decision)
            elif isinstance(decision, Move):
                if (job.state != "running" or decision.trainer not in trainer_ids or decision.trainer == job.trainer
                        or job.id not in on_trainer.get(job.trainer or "", ()) or job.preempting):
                    log.warning("policy %s: cannot move %s (%s on %s) to %s", self.policy.name, job.id, job.state,
                                job.trainer, decision.trainer)
                    continue
                self.table.set_reason(job.id, f"{decision.reason}; pausing on {job.trainer} at its next step")
                self.table.after_commit(lambda job=job, decision=decision, now=snapshot.time:
                                        self._moving(job.id, decision, now))
                actions.append(decision)
        return actions

    def _start_moved(self, trainers: list[TrainerStatus]) -> list[Start]:
        """Start the moved jobs whose pause has landed on their target trainers, where those still hold them."""
        starts: list[Start] = []
        statuses = {t.trainer_id: t for t in trainers}
        for job_id, target in list(self.moving.items()):
            try:
                record = self.table.get(job_id)
            except KeyError:
                self.table.after_commit(lambda job_id=job_id: self.moving.pop(job_id, None))
                continue
            if record.state != "queued":
                continue   # still pausing on its old trainer (or paused / ended by the user meanwhile)
            status = statuses.get(target)
            problem = "it is gone" if status is None else self._no_room(job_id, status)
            if problem:
                log.warning("scheduler: moved job %s cannot resume on %s (%s); the policy places it", job_id, target,
                            problem)
                self.table.set_reason(job_id, f"{record.reason}; {target} no longer holds it ({problem})")
            else:
                self.table.set_state(job_id, "running", f"starting on {target} (moved)", trainer=target)
                starts.append(Start(job_id, target))
            self.table.after_commit(lambda job_id=job_id: self.moving.pop(job_id, None))
        return starts

    def _no_room(self, job_id: str, status: TrainerStatus) -> str | None:
        """Why the trainer cannot take the job now (memory budget, max_jobs), or None."""
        view = self.trainer_view(status)
        here = [r for r in self.table.all(("running",)) if r.trainer == status.trainer_id]
        if view.max_jobs is not None and len(here) >= view.max_jobs:
            return f"it runs {view.max_jobs} jobs (max_jobs)"
        held = memory_in_use(view, []) + sum(self.memory.get(r.id, 0) for r in here)
        need = self.memory.get(job_id, 0)
        if held + need > view.memory_budget_bytes:
            return f"{max(view.memory_budget_bytes - held, 0) / 2**20:.0f} MiB free, it needs {need / 2**20:.0f} MiB"
        return None

    def _moving(self, job_id: str, decision: Move, now: float) -> None:
        self.preempting[job_id] = f"moving to {decision.trainer}: {decision.reason}"
        self.moving[job_id] = decision.trainer
        self.moved_at[job_id] = now
        self._decided("move", job_id, decision.reason)

    def _waits(self, job_id: str, decision: Wait) -> None:
        self.wait_causes[job_id] = decision.cause
        self._decided(f"wait_{decision.cause}", job_id, decision.reason)

    def _preempting(self, job_id: str, decision: Preempt) -> None:
        self.preempting[job_id] = f"preempted: {decision.reason}"
        self._decided("preempt", job_id, decision.reason)

    # -- third-party policy code, contained -----------------------------------------------------------------
    def _decide(self, snapshot: Snapshot) -> list[Decision]:
        """The policy's decisions. If it raises (or answers with something that is not a list of
        decisions), find the queued jobs it fails on by asking about each alone, park those with the
        reason and decide for the rest; if it fails even with no queued job, or on every one, replace it
        with FIFO for the rest of this service's life (logged)."""
        try:
            return self._ask(snapshot)
        except Exception as error:  # noqa: BLE001 - plug-in code: contained below
            first = error
        queued = [j for j in snapshot.jobs if j.state == "queued"]
        others = tuple(j for j in snapshot.jobs if j.state != "queued")
        try:
            self._ask(replace(snapshot, jobs=others))
        except Exception as error:  # noqa: BLE001 - plug-in code failing with no queued job: FIFO takes over
            return self._fall_back(snapshot, error)
        culprits: dict[str, Exception] = {}
        for job in queued:
            try:
                self._ask(replace(snapshot, jobs=(*others, job)))
            except Exception as error:  # noqa: BLE001 - plug-in code: this job is parked, the others go on
                culprits[job.id] = error
        if (not culprits or len(culprits) == len(queued) > 1
                or len(self.parked_by_policy) + len(culprits) >= POLICY_FAILURES_BEFORE_FIFO):
            return self._fall_back(snapshot, first)
        for job in queued:
            if job.id in culprits:
                self._park(self.table.get(job.id), f"the scheduling policy '{self.policy.name}' fails on this "
                                                   f"job: {culprits[job.id]!r}")
                self.parked_by_policy.add(job.id)
        rest = replace(snapshot, jobs=tuple(j for j in snapshot.jobs if j.id not in culprits))
        try:
            return self._ask(rest)
        except Exception as error:  # noqa: BLE001 - fails only in combination: give up on the policy
            return self._fall_back(rest, error)

    def _ask(self, snapshot: Snapshot) -> list[Decision]:
        decisions = self.policy.decide(snapshot)
        if not isinstance(decisions, list) or not all(isinstance(d, (Start, Preempt, Move, Wait)) for d in decisions):
            raise TypeError(f"policy {getattr(self.policy, 'name', '?')!r} returned {decisions!r:.200}, not a "
                            "list of Start / Preempt / Move / Wait")
        if any(j.state == "queued" for j in snapshot.jobs):
            self.parked_by_policy.clear()   # it works with queued jobs: earlier parked jobs were its exceptions
        return decisions

    def _fall_back(self, snapshot: Snapshot, error: Exception) -> list[Decision]:
        """Replace the policy by FIFO (logged, and reported by the service's info) and give back the jobs
        parked because of it: they were not at fault."""
        name = getattr(self.policy, "name", type(self.policy).__name__)
        self.policy_error = (f"policy '{name}' failed ({error!r}); the service schedules FIFO until it restarts "
                             "with a working policy")
        log.error("scheduler: %s", self.policy_error, exc_info=error)
        self.policy = FifoPolicy()
        for job_id in sorted(self.parked_by_policy):
            if self.table.get(job_id).state == "paused":
                self.table.set_state(job_id, "queued", f"policy '{name}' was replaced by FIFO", trainer=None)
        self.parked_by_policy.clear()
        return self._ask(replace(snapshot, jobs=tuple(self._refresh(snapshot.jobs))))

    def _refresh(self, jobs: tuple[JobView, ...]) -> list[JobView]:
        """The views with the states now in the table (jobs given back by `_fall_back` are queued again)."""
        states = {r.id: r.state for r in self.table.all(ACTIVE_STATES)}
        return [replace(j, state=states[j.id]) for j in jobs if j.id in states]

    def _park(self, record: JobRecord, why: str) -> None:
        """Take a job out of scheduling with the reason (paused: `aspen resume` once the cause is fixed)."""
        log.error("scheduler: job %s parked: %s", record.id, why)
        if record.state == "running":
            return   # it keeps training; it is only left out of this round's decisions
        self.table.set_state(record.id, "paused", f"{why}; the other jobs go on (resume it once the cause is fixed)",
                             trainer=None)

    def _decided(self, kind: str, job_id: str, reason: str) -> None:
        if self.on_decision is not None:
            self.on_decision(kind, job_id, reason)

    def trainer_view(self, status: TrainerStatus) -> TrainerView:
        """The trainer's fixed memory (its weights) and a full step's memory (its probe-measured estimate)."""
        shapes = tuple((name, i, o) for name, (i, o) in sorted(status.linear_shapes.items()))
        # Weights known exactly, and a full step by the trainer's estimate from its probe steps (measured by
        # the allocator at start). The fitted model is not used here: fitted while the same jobs are held,
        # its constant and per-token slope fold their adapters in, and the view (which adds each job's
        # adapter bytes itself) would count them twice and stay inflated after they leave. The trainer's
        # own per-step gate uses the fitted model, with the jobs as features of their own.
        fixed = status.base_bytes
        step_memory = status.activation_bytes_estimate
        rate = (status.tokens - status.padding_tokens) / status.busy_seconds if status.busy_seconds > 0 else None
        return TrainerView(status.trainer_id, status.base_model, status.quantization, status.memory_budget_bytes,
                           fixed, step_memory, tuple(status.jobs), shapes, status.max_jobs,
                           status.base_bytes + status.activation_bytes_estimate, rate or None)

    def _submission(self, job_id: str) -> JobSubmission:
        if job_id not in self.submissions:
            self.submissions[job_id] = self.table.submission(job_id)
        return self.submissions[job_id]

    def _job_view(self, record: JobRecord, trainers: tuple[TrainerView, ...]) -> JobView | None:
        """The policy's view of a job; None for a job just failed (it can never run)."""
        spec = self._submission(record.id)
        same_base = [t for t in trainers if t.base_model == record.base_model and t.quantization == record.quantization]
        if record.id not in self.memory and same_base:
            try:
                self.memory[record.id] = job_adapter_bytes(spec.job.lora, same_base[0])
            except ValueError as error:   # target_modules that the base model does not have
                self.table.set_state(record.id, "failed", str(error), trainer=None)
                return None
        if record.state == "queued" and same_base:
            problem = self._never_fits(spec, self.memory[record.id], same_base)
            if problem:
                self.table.set_state(record.id, "failed", f"cannot run on any trainer: {problem}", trainer=None)
                return None
        if record.step and record.tokens:
            tokens_per_step = record.tokens / record.step
        else:   # not measured yet: half of max_seq_len per sequence (a preference pair is two)
            tokens_per_step = (spec.job.batch_size * spec.job.grad_accum * spec.job.max_seq_len / 2
                               * spec.job.sequences_per_example)
        total = record.total_steps if record.total_steps is not None else spec.job.max_steps
        return JobView(record.id, record.name, record.state, record.priority, record.submitted_at,
                       record.base_model, record.quantization, record.trainer, record.step, total,
                       self.memory.get(record.id), tokens_per_step, self.predicted_remaining.get(record.id),
                       record.id in self.preempting, self._moving_to(record), self.moved_at.get(record.id))

    def _moving_to(self, record: JobRecord) -> str | None:
        target = self.moving.get(record.id)
        return target if record.state == "running" and record.trainer != target else None
