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
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from actors.engine.extras import DISTRIBUTION
from actors.service.scheduler.config import MetricsConfig
from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from orchestrator.metric_families import (
    AccountMetrics,
    RunningJobMetrics,
    SchedulerMetrics,
    SweepMetrics,
    TrainerMetrics,
)

log = logging.getLogger(__name__)


class MetricsListener:
    """Keeps the service's metrics (their families: orchestrator/metric_families.py); `serve=False` only collects
    (for tests that read `registry`)."""

    def __init__(self, config: MetricsConfig, *, serve: bool = True):
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True)
        self.build_info = Gauge("aspen_build_info", "Always 1; the labels say which aspen, torch and Python run",
                                ["version", "torch", "python"], registry=self.registry)
        self.build_info.labels(_aspen_version(), _torch_version(), platform.python_version()).set(1)
        self.trainers = TrainerMetrics(self.registry)
        self.scheduler = SchedulerMetrics(self.registry)
        self.running = RunningJobMetrics(self.registry)
        self.users = AccountMetrics(self.registry)
        self.sweep_metrics = SweepMetrics(self.registry)
        self.server: WSGIServer | None = None
        self.url: str | None = None
        self.error: str | None = None          # why there is no endpoint (the port was taken)
        if serve:
            self._serve()

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
        self.scheduler.job_changed(record, previous)
        if record.state != "running":
            self.running.drop(record.id)

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        self.trainers.polled(status, events)

    def trainer_retired(self, trainer_id: str) -> None:
        """Its series go: a retired trainer's last gauges (its jobs, its memory) would stay on the dashboards."""
        self.trainers.remove(trainer_id)

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        self.scheduler.decided(kind)

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        self.running.tick(jobs)
        self.scheduler.tick(jobs, counts)

    def sweeps(self, statuses: list[dict]) -> None:
        """Each sweep's trial counts by state and its best objective."""
        self.sweep_metrics.update(statuses)

    def accounts(self, rows: list[dict]) -> None:
        """The users' usage as counters, grown by what the table's totals grew (deleted jobs' included: they
        never go down, across a restart of the service too)."""
        self.users.update(rows)

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
