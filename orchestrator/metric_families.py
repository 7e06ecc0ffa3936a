"""The service's Prometheus metric families, one class per thing they describe: the trainers' fused steps and
polled state, the scheduler's jobs and decisions, the running jobs' own series, the users' accounts and the
sweeps. Each defines its families in the registry it is given and updates them from plain records (no Ray);
`orchestrator.metrics.MetricsListener` feeds them what the scheduler hears and serves the registry.

Naming (docs/monitoring.md): every metric starts with `aspen_`, uses base units (`_seconds`, `_bytes`),
counters end in `_total` (prometheus_client adds it), `_ratio` gauges lie in 0..1."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from actors.service.table.job_table import JOB_STATES, JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from policies.base import WAIT_CAUSES

TRIAL_STATES = ("pending", "running", "completed", "stopped", "failed", "cancelled", "continued")
DECISION_KINDS = ("start", "preempt", "move", *(f"wait_{cause}" for cause in WAIT_CAUSES))
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ENDED_SWEEP_SERIES_S = 600.0   # an ended sweep's series stay this long (SweepMetrics)
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class TrainerMetrics:
    """Per trainer: its fused steps (from their step events) and its polled state."""

    def __init__(self, r: CollectorRegistry):
        self.tokens = Counter("aspen_tokens", "Tokens through fused steps: kind=effective (real tokens) or padding",
                              ["trainer", "kind"], registry=r)
        self.steps = Counter("aspen_trainer_steps", "Fused steps run", ["trainer"], registry=r)
        self.busy = Counter("aspen_trainer_busy_seconds", "Seconds spent in fused steps (rate() = utilisation)",
                            ["trainer"], registry=r)
        self.step_duration = Histogram("aspen_step_duration_seconds", "Duration of one fused step", ["trainer"],
                                       buckets=STEP_BUCKETS, registry=r)
        self.padding = Gauge("aspen_padding_ratio", "Padding tokens / all tokens of the trainer's fused steps, "
                             "cumulative since the trainer started", ["trainer"], registry=r)
        self.utilization = Gauge("aspen_trainer_utilization_ratio", "Time in fused steps / wall time, cumulative "
                                 "since the trainer started", ["trainer"], registry=r)
        self.jobs = Gauge("aspen_trainer_jobs", "Jobs on the trainer now", ["trainer"], registry=r)
        self.memory_in_use = Gauge("aspen_memory_in_use_bytes", "Memory the trainer holds now (CUDA allocated, "
                                   "or the process's resident set on CPU)", ["trainer"], registry=r)
        self.step_peak = Gauge("aspen_step_peak_memory_bytes", "Measured peak memory of the last fused step (the "
                               "allocator's on CUDA; on CPU the process's peak resident set during the step)",
                               ["trainer"], registry=r)
        self.step_predicted = Gauge("aspen_step_predicted_peak_memory_bytes", "Peak memory the trainer admitted the "
                                    "last fused step by (on CPU the process's resident set)", ["trainer"], registry=r)
        self.budget = Gauge("aspen_memory_budget_bytes", "The trainer's memory budget", ["trainer"], registry=r)

    def polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        trainer = status.trainer_id
        for event in events:
            if event.kind == "step":
                self._step(trainer, event.data)
        for kind in ("effective", "padding"):   # every trainer has both series from its first poll
            self.tokens.labels(trainer, kind)
        self.steps.labels(trainer)
        self.busy.labels(trainer)
        self.padding.labels(trainer).set(status.padding_tokens / status.tokens if status.tokens else 0.0)
        elapsed = time.time() - status.started_at
        self.utilization.labels(trainer).set(min(status.busy_seconds / elapsed, 1.0) if elapsed > 0 else 0.0)
        self.jobs.labels(trainer).set(len(status.jobs))
        self.memory_in_use.labels(trainer).set(status.memory_in_use_bytes)
        self.budget.labels(trainer).set(status.memory_budget_bytes)

    def remove(self, trainer: str) -> None:
        """Every series of a trainer that is gone for good (retired: its node left the cluster)."""
        for kind in ("effective", "padding"):
            self.tokens.remove(trainer, kind)   # a no-op for a series never set
        for metric in (self.steps, self.busy, self.step_duration, self.padding, self.utilization, self.jobs,
                       self.memory_in_use, self.step_peak, self.step_predicted, self.budget):
            metric.remove(trainer)

    def _step(self, trainer: str, row: dict) -> None:
        tokens, padding, seconds = int(row["tokens"]), int(row["padding_tokens"]), float(row["seconds"])
        self.tokens.labels(trainer, "effective").inc(tokens - padding)
        self.tokens.labels(trainer, "padding").inc(padding)
        self.steps.labels(trainer).inc()
        self.busy.labels(trainer).inc(seconds)
        self.step_duration.labels(trainer).observe(seconds)
        resident = row.get("resident_peak_bytes")
        self.step_peak.labels(trainer).set(row["peak_memory_bytes"] if resident is None else resident)
        predicted = row.get("predicted_resident_bytes")
        if predicted is None:
            predicted = row.get("predicted_memory_bytes")
        if predicted is not None:
            self.step_predicted.labels(trainer).set(predicted)


class SchedulerMetrics:
    """The job table's states, queue waits and the scheduler's decisions."""

    def __init__(self, r: CollectorRegistry):
        self.jobs = Gauge("aspen_jobs", "Jobs in each state", ["state"], registry=r)
        self.queue_wait = Histogram("aspen_queue_wait_seconds", "Submission to first start, once per job",
                                    buckets=WAIT_BUCKETS, registry=r)
        self.oldest_queued = Gauge("aspen_oldest_queued_job_wait_seconds", "Seconds since the oldest queued job "
                                   "was submitted (0 when none waits)", registry=r)
        self.early_stops = Counter("aspen_early_stops", "Jobs stopped early by their stop rule", registry=r)
        self.preemptions = Counter("aspen_preemptions", "Running jobs preempted (paused and queued again)",
                                   registry=r)
        self.deferred = Counter("aspen_admissions_deferred", "A queued job was not started, once per job and "
                                "cause (memory, slots, no_trainer, priority, other)", ["cause"], registry=r)
        self.decisions = Counter("aspen_scheduler_decisions", "Scheduling decisions by kind (start, preempt, move, "
                                 "wait_<cause>)", ["kind"], registry=r)
        for cause in WAIT_CAUSES:
            self.deferred.labels(cause)
        for kind in DECISION_KINDS:
            self.decisions.labels(kind)

    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        if record.state == "running" and previous == "queued":
            self.decisions.labels("start").inc()
            if record.started_at is not None and record.started_at == record.updated_at:   # its first start
                self.queue_wait.observe(max(record.started_at - record.submitted_at, 0.0))
        if record.state == "stopped_early":
            self.early_stops.inc()

    def decided(self, kind: str) -> None:
        if kind not in DECISION_KINDS:   # a plug-in policy's own wait cause: one label for all (bounded)
            kind = "wait_other"
        self.decisions.labels(kind).inc()
        if kind == "preempt":
            self.preemptions.inc()
        elif kind.startswith("wait_"):
            self.deferred.labels(kind.removeprefix("wait_")).inc()

    def tick(self, jobs: list[JobRecord], counts: dict[str, int]) -> None:
        now = time.time()
        queued = [now - record.submitted_at for record in jobs if record.state == "queued"]
        for state in JOB_STATES:
            self.jobs.labels(state).set(counts.get(state, 0))
        self.oldest_queued.set(max(queued, default=0.0))


class RunningJobMetrics:
    """The `aspen_job_*` series of RUNNING jobs only (label `job_id`): removed as soon as a job leaves `running`,
    so that the labels stay bounded."""

    def __init__(self, r: CollectorRegistry):
        self.lock = threading.Lock()
        self.series: set[str] = set()          # running jobs that have aspen_job_* series
        self.tokens_seen: dict[str, int] = {}  # each such job's account_tokens as its counter has them
        self.loss = Gauge("aspen_job_loss", "The running job's last training loss", ["job_id"], registry=r)
        self.tokens = Counter("aspen_job_tokens", "Real tokens of every fused step the running job took part in "
                              "(those it trains again after resuming from an earlier checkpoint count again; its "
                              "user's account counts the same)", ["job_id"], registry=r)
        self.speed = Gauge("aspen_job_tokens_per_second", "The running job's tokens per second over its "
                           "last optimizer step", ["job_id"], registry=r)
        self.step = Gauge("aspen_job_step", "The running job's optimizer step", ["job_id"], registry=r)
        self.reward = Gauge("aspen_job_reward", "The running grpo job's mean reward over its last optimizer step's "
                            "completions", ["job_id"], registry=r)
        self.reward_margin = Gauge("aspen_job_reward_margin", "The running dpo / orpo / cpo job's mean reward margin "
                                   "(chosen over rejected) in its last optimizer step", ["job_id"], registry=r)

    def tick(self, jobs: list[JobRecord]) -> None:
        running = {record.id for record in jobs if record.state == "running"}
        for record in jobs:
            if record.state == "running":
                self.set(record)
        for job_id in self.series - running:   # ended, paused or deleted since: its series go
            self.drop(job_id)

    def set(self, record: JobRecord) -> None:
        with self.lock:
            self.series.add(record.id)
            self.step.labels(record.id).set(record.step)
            # a new series starts at the job's account so far, then grows by each update's increase. Its account,
            # kept in the job table, only grows: a series that went while the job was paused or queued, or with
            # the service's process, comes back no lower (Prometheus would read a lower one as a counter reset
            # and count it whole again). `tokens` restarts at the checkpoint's count when a job resumes.
            counter = self.tokens.labels(record.id)
            grown = record.account_tokens - self.tokens_seen.get(record.id, 0)
            if grown > 0:
                counter.inc(grown)
                self.tokens_seen[record.id] = record.account_tokens
            if record.loss is not None:
                self.loss.labels(record.id).set(record.loss)
            if record.tokens_per_s is not None:
                self.speed.labels(record.id).set(record.tokens_per_s)
            if record.reward is not None:
                self.reward.labels(record.id).set(record.reward)
            if record.reward_margin is not None:
                self.reward_margin.labels(record.id).set(record.reward_margin)

    def drop(self, job_id: str) -> None:
        with self.lock:
            if job_id not in self.series:
                return
            self.series.discard(job_id)
            self.tokens_seen.pop(job_id, None)
            for metric in (self.loss, self.tokens, self.speed, self.step, self.reward, self.reward_margin):
                metric.remove(job_id)   # a no-op for a series never set (e.g. no loss yet)


class AccountMetrics:
    """The users' accounts (docs/users.md) as counters, bounded by the service's users (jobs through Ray: user
    ""): each grows by what the table's totals grew since the last round. The totals count deleted jobs too
    (`UsageAccounts.ever_used`), so they never fall, and a restarted service's counters start no lower."""

    def __init__(self, r: CollectorRegistry):
        self.counters = {
            "tokens": Counter("aspen_user_trained_tokens_total", "Real tokens a user's jobs trained (every fused "
                              "step they took part in)", ["user"], registry=r),
            "step_seconds": Counter("aspen_user_step_seconds_total", "A user's jobs' shares of the fused steps' "
                                    "time, by their tokens", ["user"], registry=r),
            "gpu_seconds": Counter("aspen_user_gpu_seconds_total", "A user's step-seconds times the GPUs each step "
                                   "ran on", ["user"], registry=r)}
        self.accounted: dict[tuple[str, str], float] = {}

    def update(self, rows: list[dict]) -> None:
        for row in rows:
            user = row["user"] or ""
            for key, counter in self.counters.items():
                before = self.accounted.get((user, key), 0.0)
                if row[key] > before:
                    counter.labels(user).inc(row[key] - before)
                    self.accounted[(user, key)] = row[key]


class SweepMetrics:
    """Each sweep's trials by state and its best objective (docs/sweeps.md), while it runs and ENDED_SWEEP_SERIES_S
    after it ended (done, cancelled, failed: time for Prometheus to scrape its end), then gone: the service's sweeps
    only add up, so their series would grow the page without end. A sweep running again (a trial its user
    continues) has them again."""

    def __init__(self, r: CollectorRegistry, clock=time.monotonic):
        self.clock = clock
        self.ended_at: dict[str, float] = {}   # each ended sweep with series: when this process saw it end
        self.shown: set[str] = set()           # the sweeps with series
        self.trials = Gauge("aspen_sweep_trials", "A sweep's trials in each state (pending, running, completed, "
                            "stopped, failed, cancelled, continued)", ["sweep", "state"], registry=r)
        self.best = Gauge("aspen_sweep_best_objective", "The objective of the sweep's best completed trial (its "
                          "loss: lower is better)", ["sweep"], registry=r)

    def update(self, statuses: list[dict]) -> None:
        """A sweep without a completed trial has no best series."""
        now = self.clock()
        for status in statuses:
            name = status["name"]
            if status["state"] == "running":
                self.ended_at.pop(name, None)
            elif now - self.ended_at.setdefault(name, now) > ENDED_SWEEP_SERIES_S:
                self._remove(name)
                continue
            self.shown.add(name)
            for state in TRIAL_STATES:
                self.trials.labels(name, state).set(sum(t["state"] == state for t in status["trials"]))
            best = next((t["objective"] for t in status["trials"] if t["name"] == status.get("best")), None)
            if best is not None:
                self.best.labels(name).set(best)
        for name in self.shown - {status["name"] for status in statuses}:   # no longer the service's
            self._remove(name)
            self.ended_at.pop(name, None)

    def _remove(self, name: str) -> None:
        if name not in self.shown:
            return
        self.shown.discard(name)
        for state in TRIAL_STATES:
            self.trials.remove(name, state)
        self.best.remove(name)   # a no-op for a series never set
