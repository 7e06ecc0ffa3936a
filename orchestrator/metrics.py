"""The service's Prometheus endpoint: a `ServiceListener` that turns what the scheduler hears (fused steps,
trainer polls, job state changes, scheduling decisions, ticks) into metrics in a registry of its own and
serves them on `http://<metrics.host>:<metrics.port>/metrics` (default 127.0.0.1:9464; port 0 = any free
port, the bound one is in `describe()`).

Naming: every metric starts with `aspen_`, uses base units (`_seconds`, `_bytes`), counters end in
`_total`, `_ratio` gauges lie in 0..1. Labels stay bounded: `trainer` (the service's trainer ids),
`state`, `kind`, `cause`, and `job_id` only on the `aspen_job_*` series of RUNNING jobs, which are
removed as soon as the job leaves `running` (`job_id`, not `job`: Prometheus gives every scraped
series `job`, the scrape job's name). If the port is taken the service runs on without metrics (a
warning says how to pick another port)."""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import threading
import time
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from actors.engine.extras import DISTRIBUTION
from actors.service.scheduler.config import MetricsConfig
from actors.service.table.job_table import JOB_STATES, JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus

TRIAL_STATES = ("pending", "running", "completed", "stopped", "failed", "cancelled")
log = logging.getLogger(__name__)

WAIT_CAUSES = ("memory", "slots", "host", "no_trainer", "priority", "quota", "other")
DECISION_KINDS = ("start", "preempt", "move", *(f"wait_{cause}" for cause in WAIT_CAUSES))
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class MetricsListener:
    """Keeps the service's metrics; `serve=False` only collects (for tests that read `registry`)."""

    def __init__(self, config: MetricsConfig, *, serve: bool = True):
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self.lock = threading.Lock()
        self.job_series: set[str] = set()      # running jobs that have aspen_job_* series
        self.job_tokens_seen: dict[str, int] = {}   # each such job's token count at its last update
        self.server: WSGIServer | None = None
        self.url: str | None = None
        self.error: str | None = None          # why there is no endpoint (the port was taken)
        self._define()
        if serve:
            self._serve()

    def _define(self) -> None:
        r = self.registry
        self.build_info = Gauge("aspen_build_info", "Always 1; the labels say which aspen, torch and Python run",
                                ["version", "torch", "python"], registry=r)
        self.build_info.labels(_aspen_version(), _torch_version(), platform.python_version()).set(1)
        # trainers, from their fused steps (step events) and their polled status
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
        self.trainer_jobs = Gauge("aspen_trainer_jobs", "Jobs on the trainer now", ["trainer"], registry=r)
        self.memory_in_use = Gauge("aspen_memory_in_use_bytes", "Memory the trainer holds now (CUDA allocated, "
                                   "or the process's resident set on CPU)", ["trainer"], registry=r)
        self.step_peak = Gauge("aspen_step_peak_memory_bytes", "Measured peak memory of the last fused step (the "
                               "allocator's on CUDA; on CPU the process's peak resident set during the step)",
                               ["trainer"], registry=r)
        self.step_predicted = Gauge("aspen_step_predicted_peak_memory_bytes", "Peak memory the trainer admitted the "
                                    "last fused step by (on CPU the process's resident set)", ["trainer"], registry=r)
        self.budget = Gauge("aspen_memory_budget_bytes", "The trainer's memory budget", ["trainer"], registry=r)
        # jobs and the scheduler
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
        # running jobs only (series removed when the job leaves running)
        self.job_loss = Gauge("aspen_job_loss", "The running job's last training loss", ["job_id"], registry=r)
        self.job_tokens = Counter("aspen_job_tokens", "Tokens the running job has trained on (a job resumed from "
                                  "an earlier checkpoint does not take any back: it adds what it trains from "
                                  "there)", ["job_id"], registry=r)
        self.job_speed = Gauge("aspen_job_tokens_per_second", "The running job's tokens per second over its "
                               "last optimizer step", ["job_id"], registry=r)
        self.job_step = Gauge("aspen_job_step", "The running job's optimizer step", ["job_id"], registry=r)
        # users' accounts (docs/users.md): bounded by the service's users (jobs through Ray: user "")
        self.user_tokens = Counter("aspen_user_trained_tokens_total", "Real tokens a user's jobs trained (every "
                                   "fused step they took part in)", ["user"], registry=r)
        self.user_step_seconds = Counter("aspen_user_step_seconds_total", "A user's jobs' shares of the fused "
                                         "steps' time, by their tokens", ["user"], registry=r)
        self.user_gpu_seconds = Counter("aspen_user_gpu_seconds_total", "A user's step-seconds times the GPUs each "
                                        "step ran on", ["user"], registry=r)
        self._accounted: dict[tuple[str, str], float] = {}
        # sweeps (docs/sweeps.md): bounded by the service's sweeps
        self.sweep_trials = Gauge("aspen_sweep_trials", "A sweep's trials in each state (pending, running, "
                                  "completed, stopped, failed, cancelled)", ["sweep", "state"], registry=r)
        self.sweep_best = Gauge("aspen_sweep_best_objective", "The objective of the sweep's best completed trial "
                                "(its loss: lower is better)", ["sweep"], registry=r)

    def _serve(self) -> None:
        host, port = self.config.host, self.config.port
        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            self.error = (f"cannot serve metrics on {host}:{port} ({error}); the service runs without metrics. "
                          "Set another `metrics.port` in the service config (0 = any free port), or "
                          "`metrics.enabled: false`")
            log.warning("metrics: %s", self.error)
            return
        bound = self.server.server_port
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}/metrics"
        log.info("metrics: serving %s", self.url)

    # -- ServiceListener -------------------------------------------------------------------------------------
    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        if record.state == "running" and previous == "queued":
            self.decisions.labels("start").inc()
            if record.started_at is not None and record.started_at == record.updated_at:   # its first start
                self.queue_wait.observe(max(record.started_at - record.submitted_at, 0.0))
        if record.state == "stopped_early":
            self.early_stops.inc()
        if record.state != "running":
            self._drop_job(record.id)

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        trainer = status.trainer_id
        for event in events:
            if event.kind != "step":
                continue
            row = event.data
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
        for kind in ("effective", "padding"):   # every trainer has both series from its first poll
            self.tokens.labels(trainer, kind)
        self.steps.labels(trainer)
        self.busy.labels(trainer)
        self.padding.labels(trainer).set(status.padding_tokens / status.tokens if status.tokens else 0.0)
        elapsed = time.time() - status.started_at
        self.utilization.labels(trainer).set(min(status.busy_seconds / elapsed, 1.0) if elapsed > 0 else 0.0)
        self.trainer_jobs.labels(trainer).set(len(status.jobs))
        self.memory_in_use.labels(trainer).set(status.memory_in_use_bytes)
        self.budget.labels(trainer).set(status.memory_budget_bytes)

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        self.decisions.labels(kind).inc()
        if kind == "preempt":
            self.preemptions.inc()
        elif kind.startswith("wait_"):
            self.deferred.labels(kind.removeprefix("wait_")).inc()

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        now = time.time()
        oldest = 0.0
        running = set()
        for record in jobs:
            if record.state == "queued":
                oldest = max(oldest, now - record.submitted_at)
            if record.state == "running":
                running.add(record.id)
                self._set_job(record)
        for job_id in self.job_series - running:   # ended, paused or deleted since: its series go
            self._drop_job(job_id)
        for state in JOB_STATES:
            self.jobs.labels(state).set(counts.get(state, 0))
        self.oldest_queued.set(oldest)

    def sweeps(self, statuses: list[dict]) -> None:
        """Each sweep's trial counts by state and its best objective (a sweep without a completed trial has
        no best series)."""
        for status in statuses:
            name = status["name"]
            for state in TRIAL_STATES:
                self.sweep_trials.labels(name, state).set(sum(t["state"] == state for t in status["trials"]))
            best = next((t["objective"] for t in status["trials"] if t["name"] == status.get("best")), None)
            if best is not None:
                self.sweep_best.labels(name).set(best)

    def accounts(self, rows: list[dict]) -> None:
        """The users' accounts as counters: each grows by what the table's totals grew since the last round
        (a total that fell, a job deleted, is not taken back)."""
        for row in rows:
            user = row["user"] or ""
            for key, counter in (("tokens", self.user_tokens), ("step_seconds", self.user_step_seconds),
                                 ("gpu_seconds", self.user_gpu_seconds)):
                before = self._accounted.get((user, key), 0.0)
                if row[key] > before:
                    counter.labels(user).inc(row[key] - before)
                    self._accounted[(user, key)] = row[key]

    def describe(self) -> dict[str, str]:
        if self.url:
            return {"metrics_url": self.url}
        return {"metrics_error": self.error} if self.error else {}

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
            self.url = None

    # -- running jobs' series ----------------------------------------------------------------------------------
    def _set_job(self, record: JobRecord) -> None:
        with self.lock:
            self.job_series.add(record.id)
            self.job_step.labels(record.id).set(record.step)
            # a new series starts at the job's count so far, then grows by each update's increase; a job
            # resumed from a checkpoint restarts its count lower, which adds nothing (counters never go down)
            counter = self.job_tokens.labels(record.id)
            grown = record.tokens - self.job_tokens_seen.get(record.id, 0)
            if grown > 0:
                counter.inc(grown)
            self.job_tokens_seen[record.id] = record.tokens
            if record.loss is not None:
                self.job_loss.labels(record.id).set(record.loss)
            if record.tokens_per_s is not None:
                self.job_speed.labels(record.id).set(record.tokens_per_s)

    def _drop_job(self, job_id: str) -> None:
        with self.lock:
            if job_id not in self.job_series:
                return
            self.job_series.discard(job_id)
            self.job_tokens_seen.pop(job_id, None)
            for metric in (self.job_loss, self.job_tokens, self.job_speed, self.job_step):
                metric.remove(job_id)   # a no-op for a series never set (e.g. no loss yet)


def _aspen_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        log.warning("metrics: the %s distribution is not installed (run from a source tree?); "
                    "aspen_build_info says version=unknown", DISTRIBUTION)
        return "unknown"


def _torch_version() -> str:
    """torch's installed version, read from its package metadata: the scheduler, which exports these metrics,
    never imports torch itself (seconds of start-up and some 300 MB of memory for one label)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"
