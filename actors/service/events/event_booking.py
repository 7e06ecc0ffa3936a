"""Booking what trainers report into the job table: a job's start, progress, evaluations, checkpoints,
predicted early stop and end, a job given back by its trainer, and the jobs of a lost trainer.

A job given back (its job actor lost or hung) is queued again a bounded number of times; the jobs of a lost
trainer resume elsewhere from their checkpoints. Events are booked inside the caller's transaction, so that
a batch the table could not take (another process holds its file) is retried whole, never half-applied or
dropped; the scheduler's memory of a job (`SchedulingStates`) changes only once that transaction commits."""

from __future__ import annotations

import logging
import math

from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.table.job_record import JobRecord, unreported_resume_point
from actors.service.table.job_table import TERMINAL_STATES, JobTable
from actors.service.trainer.trainer_reports import TrainerEvent

log = logging.getLogger(__name__)

DIVERGED = "its loss is not finite"   # a running job's reason says so from its first such step to its end
MAX_RETRIES = 3   # a job its trainer gave back (job actor lost or hung) is queued again this often, then fails


class EventBooking:
    def __init__(self, table: JobTable, scheduling: SchedulingStates):
        self.table = table
        self.scheduling = scheduling

    def apply_event(self, trainer_id: str, event: TrainerEvent) -> None:
        """Book one trainer event in the table. Called inside the caller's transaction: changes to the
        jobs' states in memory are made only once that transaction commits."""
        if event.kind == "step":   # the trainer's own step row: its jobs' users are accounted their shares of it
            self._account(event.data)
            return
        job_id, data = event.job_id, event.data
        try:
            record = self.table.get(job_id)
        except KeyError:
            log.warning("trainer %s reported on unknown job %s", trainer_id, job_id)
            return
        if record.state in TERMINAL_STATES:
            self._reported_late(record, event)
            return
        kind = event.kind
        after = self.table.after_commit
        state = self.scheduling.get(job_id)
        if kind == "started":
            self._started(trainer_id, event)
        elif kind == "progress":
            self._progress(record, event)
        elif kind == "eval":
            self.table.progress.add_eval(job_id, event.step, data["eval_loss"], data.get("eval_score"))
            self.table.update(job_id, eval_loss=data["eval_loss"], **_score(data), **_best(data))
        elif kind == "checkpoint" and data.get("upload_error"):   # the uploaded checkpoint is an older one
            self.table.update(job_id, reason=f"training on {trainer_id}; {data['upload_error']}")
        elif kind == "checkpoint":
            self.table.update(job_id, checkpoint_step=event.step)
            if data.get("upload_recovered"):
                self.table.update(job_id, reason=f"training on {trainer_id}; its checkpoints upload again")
        elif kind == "prediction":   # the job's stop rule expects it to end early: less work left
            remaining = max(int(data["predicted_stop_step"]) - event.step, 0)
            after(lambda: setattr(self.scheduling.of(job_id), "predicted_remaining", remaining))
        elif kind == "paused" and data.get("retry"):
            self.given_back(job_id, data)
        elif kind == "paused" and state is not None and state.preempting is not None:
            reason = state.preempting
            if state.moving_to is not None:
                reason = f"{reason}; paused on {trainer_id}, resumes on {state.moving_to}"
            self.table.set_state(job_id, "queued", reason, trainer=None, checkpoint_step=data.get("checkpoint_step"))
            after(lambda: setattr(state, "preempting", None))
        else:  # completed, stopped_early, cancelled, paused, failed
            columns = {"trainer": None, "step": event.step}
            for key in ("adapter_dir", "eval_loss", "eval_score", "checkpoint_step", "best"):
                if data.get(key) is not None:
                    columns[key] = data[key]
            if "eval_loss" in data:
                self.table.progress.add_eval(job_id, event.step, data["eval_loss"], data.get("eval_score"))
            self.table.set_state(job_id, kind, _diverged_too(data.get("reason", kind), record.reason), **columns)
            if state is not None:
                after(lambda: (setattr(state, "preempting", None), setattr(state, "moving_to", None)))

    def _progress(self, record: JobRecord, event: TrainerEvent) -> None:
        data = event.data
        self.table.progress.add(record.id, data)
        loss = data.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss) and DIVERGED not in record.reason:
            # strict JSON sends a NaN as null: the reason tells a diverged job from one not reported
            self.table.update(record.id, reason=f"{record.reason}; {DIVERGED} ({loss}) since step {event.step}: "
                                                "its adapter's weights diverged; train it again with a lower lr, or "
                                                "from a checkpoint before that step")
        self.table.update(record.id, step=event.step, loss=data.get("loss"), tokens=record.tokens + data["tokens"],
                          tokens_per_s=data.get("tokens_per_s"), total_steps=data.get("total_steps"),
                          **_objective(data))

    def _reported_late(self, record: JobRecord, event: TrainerEvent) -> None:
        """Work done before a completed job's end and reported after it: an interactive job is completed by its
        front (the HTTP server, once its session's final save is written) beside its trainer's own reports, so
        that trainer's reports of the last optimizer steps and checkpoints can reach the table after the end.
        They are booked (steps past the record's, once each); any other report on a finished job is dropped."""
        if record.state != "completed":
            return
        if event.kind == "progress" and event.step > (record.step or 0):
            self._progress(record, event)
        elif (event.kind == "checkpoint" and not event.data.get("upload_error")
              and event.step > (record.checkpoint_step or 0)):
            self.table.update(record.id, checkpoint_step=event.step)

    def _account(self, row: dict) -> None:
        """Each job of a fused step is accounted its real tokens and its share of the step's seconds by those
        tokens (and as many GPU-seconds times the step's GPUs), so that the accounts add up to the step log."""
        tokens = row.get("job_tokens") or {}
        total = sum(tokens.values())
        if total <= 0:
            return
        seconds, gpus = float(row.get("seconds") or 0.0), int(row.get("gpus") or 0)
        for job_id, count in tokens.items():
            share = seconds * count / total
            self.table.usage.add(job_id, int(count), share, share * gpus)

    def _started(self, trainer_id: str, event: TrainerEvent) -> None:
        """A job began (or resumed) on its trainer: a resumed job's history is the checkpoint's."""
        job_id, data = event.job_id, event.data
        resumed = data.get("resumed_from")
        # its checkpoint's best evaluation (keep_best), none from the start; the tokens its model has seen (its
        # checkpoint's, 0 from the start): not an earlier attempt's added to this one's (a restart from step 0)
        columns = {"best": data.get("best"), "tokens": data.get("tokens", 0)}
        if resumed is None:   # from step 0: an earlier attempt's rows and figures (it left no checkpoint, or its
            self.table.progress.forget_after(job_id, 0)   # checkpoint is gone) are not this one's
            columns.update(loss=None, eval_loss=None, eval_score=None, reward=None, reward_margin=None,
                           checkpoint_step=None)
        else:   # the checkpoint's history is the truth: steps after it are replayed
            self.table.progress.forget_after(job_id, resumed)
            for row in data.get("history", []):
                self.table.progress.add(job_id, row)
            for step, eval_loss in data.get("evals", []):   # add_progress replaced those rows whole
                self.table.progress.add_eval(job_id, step, eval_loss)
            for step, score in data.get("scores", []):
                self.table.progress.add_eval(job_id, step, None, score)
            last = data["history"][-1] if data.get("history") else {}
            columns = {"tokens": data.get("tokens", 0), "loss": last.get("loss"), "checkpoint_step": resumed,
                       **_objective(last)}
            if data.get("scores"):
                columns["eval_score"] = data["scores"][-1][1]
        reason = f"training on {trainer_id}" + (f", resumed from step {resumed}" if resumed else "")
        if data.get("checkpoint_note"):
            reason += f" ({data['checkpoint_note']})"
        self.table.set_state(job_id, "running", reason, trainer=trainer_id, step=event.step,
                             total_steps=data.get("total_steps"), **columns)

    def given_back(self, job_id: str, data: dict) -> None:
        """The trainer gave a job back for a reason outside the job itself (its job actor died or hung):
        queue it again with a new job actor, from the checkpoint just written, at most MAX_RETRIES times."""
        attempt = self.scheduling.of(job_id).retries + 1
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
            state = self.scheduling.of(job_id)
            state.retries = attempt
            state.replace_job_actor = True
            state.preempting = None
            state.moving_to = None   # a new job actor: the policy places it afresh
        self.table.after_commit(remember)

    def start_failed(self, job_id: str, reason: str) -> None:
        self.table.set_state(job_id, "failed", reason, trainer=None)

    def start_lost(self, job_id: str, reason: str) -> None:
        """A job's actor died before the job reached its trainer: start it again with a new one (bounded)."""
        self.given_back(job_id, {"reason": reason, "checkpoint_step": self.table.get(job_id).checkpoint_step})

    def trainer_lost(self, trainer_id: str, error: str) -> list[str]:
        """A trainer died (or its node left the cluster): its jobs are queued again and resume from their last
        checkpoints, each with a new job actor (the old one may have been on the same lost node)."""
        lost = []
        for record in self.table.all(("running",)):
            if record.trainer != trainer_id:
                continue
            if self.table.submission(record.id).job.method == "interactive":   # its front places it again
                step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "its start"
                self.table.set_state(record.id, "queued", f"trainer {trainer_id} was lost ({error}); the model "
                                     f"resumes from {step} on another when its user's loop calls again", trainer=None)
                continue
            self.table.set_state(record.id, "queued", f"trainer {trainer_id} was lost ({error}); resumes from "
                                 f"{unreported_resume_point(record.checkpoint_step)}", trainer=None)
            lost.append(record.id)

        def remember() -> None:
            for job_id in lost:
                state = self.scheduling.of(job_id)
                # a job that was pausing to move on stays pinned to its target (started there next round)
                state.preempting = None
                state.replace_job_actor = True
        self.table.after_commit(remember)
        return lost

    def expect_pause(self, job_id: str, reason: str) -> None:
        """The job's coming `paused` event means "queue it again" with `reason` (the service stopping)."""
        self.scheduling.of(job_id).preempting = reason


def _score(data: dict) -> dict[str, float]:
    """An evaluation's eval_generate score as the job's column, where it has one."""
    return {"eval_score": data["eval_score"]} if data.get("eval_score") is not None else {}


def _best(data: dict) -> dict[str, dict]:
    """A keep_best job's best evaluation so far as the job's column, where its evaluation reported one."""
    return {"best": data["best"]} if data.get("best") is not None else {}


def _objective(row: dict) -> dict[str, float]:
    """A step row's method metrics the job's record keeps (JobRecord.reward / reward_margin), where it has them."""
    found = {"reward": row.get("reward"), "reward_margin": row.get("rewards/margins")}
    return {key: value for key, value in found.items() if value is not None}


def _diverged_too(reason: str, running: str) -> str:
    """A job's end `reason`, with its running reason's note that its loss went non-finite, if it has one."""
    note = running.find(DIVERGED)
    return reason if note < 0 else f"{reason}; {running[note:]}"
