"""The Prometheus endpoint (`orchestrator.metrics`), in-process: a real trainer loop on a tiny model and a
real scheduler core (job table, fifo policy) drive a `MetricsListener` the way the scheduler actor does (the
`scenario` fixture, tests/helpers/metrics_scenario.py); its `/metrics` page, fetched over HTTP and read with
prometheus_client's own text parser, has to agree with the trainer's status, its step rows and the job table; a
job's series go when it ends; what only grows is a counter; every metric keeps Prometheus' naming rules; a taken
port is logged and the service runs on. The Grafana dashboards that read the page: test_grafana_dashboards.py."""

from __future__ import annotations

import logging
import re
import socket
import time
from collections import Counter
from dataclasses import replace

import pytest

from actors.service.scheduler.config import EventsConfig, MetricsConfig, ServiceConfig
from actors.service.table.job_table import JOB_STATES
from actors.service.trainer.trainer_reports import TrainerEvent
from orchestrator.metrics import MetricsListener
from orchestrator.observability import service_listeners
from tests.helpers.metrics_scenario import Samples, scrape

# bounded labels: trainers, fixed kinds, running jobs, the service's users (users.json: an operator's few)
ALLOWED_LABELS = {"trainer", "kind", "state", "cause", "job_id", "le", "version", "torch", "python", "user", "sweep"}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for sample, labels in samples if sample == name]


def test_trainer_metrics_match_the_trainers_status_and_step_rows(scenario):
    samples, _ = scenario.after
    status, steps = scenario.status, scenario.steps
    assert len(steps) == status.steps >= 5
    effective = sum(row["tokens"] - row["padding_tokens"] for row in steps)
    padding = sum(row["padding_tokens"] for row in steps)
    assert effective == status.tokens - status.padding_tokens > 0
    assert value(samples, "aspen_tokens_total", trainer="trainer-0", kind="effective") == effective
    assert value(samples, "aspen_tokens_total", trainer="trainer-0", kind="padding") == padding == status.padding_tokens
    assert value(samples, "aspen_trainer_steps_total", trainer="trainer-0") == status.steps
    assert value(samples, "aspen_step_duration_seconds_count", trainer="trainer-0") == len(steps)
    assert value(samples, "aspen_step_duration_seconds_sum", trainer="trainer-0") == pytest.approx(
        sum(row["seconds"] for row in steps))
    assert value(samples, "aspen_trainer_busy_seconds_total", trainer="trainer-0") == pytest.approx(
        status.busy_seconds, rel=1e-4)
    slowest = max(row["seconds"] for row in steps)
    bucket = min(b for b in (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0) if b >= slowest)
    assert value(samples, "aspen_step_duration_seconds_bucket", trainer="trainer-0", le=str(bucket)) == len(steps)
    assert value(samples, "aspen_padding_ratio", trainer="trainer-0") == pytest.approx(
        status.padding_tokens / status.tokens)
    utilization = value(samples, "aspen_trainer_utilization_ratio", trainer="trainer-0")
    assert 0 < utilization <= 1
    assert utilization == pytest.approx(status.busy_seconds / (time.time() - status.started_at), rel=0.5)
    assert value(samples, "aspen_memory_in_use_bytes", trainer="trainer-0") == status.memory_in_use_bytes > 2**20
    assert value(samples, "aspen_memory_budget_bytes", trainer="trainer-0") == status.memory_budget_bytes
    # on a CPU the peak and its prediction are the process's resident set: above the allocator's count (the
    # interpreter and libraries are resident too)
    last = steps[-1]
    assert value(samples, "aspen_step_peak_memory_bytes", trainer="trainer-0") == last["resident_peak_bytes"] \
        > last["peak_memory_bytes"] > 0
    assert value(samples, "aspen_step_predicted_peak_memory_bytes", trainer="trainer-0") == \
        last["predicted_resident_bytes"] > last["predicted_memory_bytes"] > 0
    assert value(samples, "aspen_trainer_jobs", trainer="trainer-0") == len(status.jobs) == 0


def test_job_and_scheduler_metrics_match_the_job_table(scenario):
    samples, _ = scenario.after
    records = scenario.table.all()
    counts = Counter(r.state for r in records)
    assert counts == {"completed": 1, "cancelled": 1}
    for state in JOB_STATES:
        assert value(samples, "aspen_jobs", state=state) == counts.get(state, 0)
    waits = [r.started_at - r.submitted_at for r in records]
    assert value(samples, "aspen_queue_wait_seconds_count") == 2
    assert value(samples, "aspen_queue_wait_seconds_sum") == pytest.approx(sum(waits))
    assert value(samples, "aspen_oldest_queued_job_wait_seconds") == 0
    # `long` waited for the one slot while `short` ran: one deferral (once per job and cause), two starts
    assert value(samples, "aspen_admissions_deferred_total", cause="slots") == 1
    assert value(samples, "aspen_admissions_deferred_total", cause="memory") == 0
    assert value(samples, "aspen_scheduler_decisions_total", kind="wait_slots") == 1
    assert value(samples, "aspen_scheduler_decisions_total", kind="start") == 2
    assert value(samples, "aspen_preemptions_total") == value(samples, "aspen_early_stops_total") == 0


def test_running_jobs_have_series_that_go_when_they_end(scenario):
    during, _ = scenario.during
    long = scenario.during_records[scenario.long]
    assert long.state == "running" and long.loss is not None
    for name, expected in (("aspen_job_step", long.step), ("aspen_job_tokens_total", long.tokens),
                           ("aspen_job_loss", long.loss), ("aspen_job_tokens_per_second", long.tokens_per_s)):
        assert series(during, name) == [{"job_id": scenario.long}], name    # not `short`, which had completed
        assert value(during, name, job_id=scenario.long) == pytest.approx(expected), name
    after, _ = scenario.after
    assert not [key for key in after if key[0].startswith("aspen_job_")]


def test_the_users_accounts_are_counters_that_add_up_to_the_step_rows(scenario):
    """Jobs submitted through Ray (user ""): their tokens and step-seconds counters are the sums of the
    trainer's step rows, which the scheduler booked into the job table."""
    samples = scenario.listener.registry.get_sample_value
    assert samples("aspen_user_trained_tokens_total", {"user": ""}) == sum(
        sum(row["job_tokens"].values()) for row in scenario.steps) > 0
    assert samples("aspen_user_step_seconds_total", {"user": ""}) == pytest.approx(
        sum(row["seconds"] for row in scenario.steps), rel=1e-9)
    assert samples("aspen_user_gpu_seconds_total", {"user": ""}) is None   # a CPU: none (no series)


def test_a_jobs_token_counter_only_grows_and_goes_with_its_series(scenario):
    """`aspen_job_tokens_total` is the job's account (the real tokens of every fused step it took part in, as the
    job table keeps it), not its `tokens`, which restart at the checkpoint's count when it resumes: a series that
    went while the job was preempted comes back no lower (tests/servers/test_prometheus_counters.py: as a real
    Prometheus reads it)."""
    listener = MetricsListener(MetricsConfig(port=0), serve=False)
    record = replace(scenario.during_records[scenario.long], tokens=1000, account_tokens=1000)

    def tokens() -> float | None:
        return listener.registry.get_sample_value("aspen_job_tokens_total", {"job_id": record.id})

    def tick(count: int, account: int) -> None:
        listener.tick([replace(record, tokens=count, account_tokens=account)], {"running": 1}, [scenario.status])

    families = {family.name: family.type for family in listener.registry.collect()}
    assert families["aspen_job_tokens"] == "counter"
    tick(1000, 1000)
    assert tokens() == 1000                   # a new series starts at the job's account so far
    tick(1000, 1000)
    tick(1500, 1500)
    assert tokens() == 1500
    tick(400, 1500)                           # resumed from a checkpoint: its count restarts lower, its account not
    assert tokens() == 1500
    tick(700, 1800)
    assert tokens() == 1800                   # what it trained since, again
    listener.job_changed(replace(record, state="queued"), "running")   # preempted: its series go
    assert tokens() is None and record.id not in listener.running.tokens_seen
    tick(300, 1800)                           # running again from a checkpoint: no lower than it went
    assert tokens() == 1800
    tick(400, 1900)
    assert tokens() == 1900
    listener.tick([], {}, [scenario.status])  # gone from the table
    assert tokens() is None and not listener.running.tokens_seen


def test_monotonic_values_are_counters(scenario):
    """A value that only grows is a counter (`_total`): besides the trainers' and the scheduler's counts,
    the jobs' token counts. The gauges that stay are levels, ratios, last values or positions that can go
    back (`aspen_job_step` restarts at the checkpoint's step when a job resumes)."""
    _, families = scenario.during
    kinds = {family: kind for family, kind in families.values()}
    for family in ("aspen_tokens", "aspen_trainer_steps", "aspen_trainer_busy_seconds", "aspen_early_stops",
                   "aspen_preemptions", "aspen_admissions_deferred", "aspen_scheduler_decisions",
                   "aspen_job_tokens"):
        assert kinds[family] == "counter", family
    assert "aspen_job_tokens" not in families          # only its `_total` sample is on the page
    assert kinds["aspen_job_step"] == kinds["aspen_job_tokens_per_second"] == "gauge"


def test_preemptions_early_stops_and_deferrals_are_counted(scenario):
    listener = MetricsListener(MetricsConfig(port=0))
    try:
        record = scenario.during_records[scenario.long]
        listener.tick([record], {record.state: 1}, [scenario.status])
        listener.decided("wait_memory", "a", "waiting for memory: needs 900 MiB")
        listener.decided("wait_memory", "b", "waiting for memory: needs 900 MiB")
        listener.decided("preempt", record.id, "a higher priority job")
        listener.job_changed(replace(record, state="queued"), "running")
        listener.job_changed(replace(record, state="stopped_early"), "running")
        samples, _ = scrape(listener.describe()["metrics_url"])
    finally:
        listener.close()
    assert value(samples, "aspen_admissions_deferred_total", cause="memory") == 2
    assert value(samples, "aspen_scheduler_decisions_total", kind="wait_memory") == 2
    assert value(samples, "aspen_preemptions_total") == 1
    assert value(samples, "aspen_scheduler_decisions_total", kind="preempt") == 1
    assert value(samples, "aspen_early_stops_total") == 1
    assert not [key for key in samples if key[0].startswith("aspen_job_")]   # it left running


def test_every_metric_keeps_the_naming_rules(scenario):
    during, families = scenario.during
    assert len({family for family, _ in families.values()}) >= 20
    for sample_name, (family, kind) in families.items():
        for name in (sample_name, family):
            assert name.startswith("aspen_"), name
            assert not re.search(r"_(ms|us|kb|mb|gb|kib|mib|gib|minutes|hours|percent)(_|$)", name), name
        words = set(family.split("_"))
        if words & {"memory", "budget"}:
            assert family.endswith("_bytes"), family
        if words & {"duration", "wait", "busy"}:
            assert family.removesuffix("_total").endswith("_seconds"), family
        assert family.endswith("_ratio") == ("ratio" in words) and not (kind != "gauge" and "ratio" in words), family
        assert sample_name.endswith("_total") == (kind == "counter"), (sample_name, kind)
        if kind == "histogram":
            assert sample_name.removeprefix(family) in ("_bucket", "_sum", "_count"), sample_name
    for (sample, labels), number in during.items():
        if sample.endswith("_ratio"):
            assert 0 <= number <= 1, (sample, number)
        names = {label for label, _ in labels}
        assert names <= ALLOWED_LABELS, (sample, names)
        assert ("job_id" in names) == sample.startswith("aspen_job_"), sample
    info = series(during, "aspen_build_info")
    assert len(info) == 1 and info[0]["version"] and info[0]["torch"] and info[0]["python"]


def test_a_retired_trainers_series_go_and_the_others_stay(scenario):
    """A trainer retired (its node left the cluster; one that joins gets a new id) leaves no series behind:
    its last gauges (jobs on it, memory in use) would stay on the dashboards, and the labels grow with every
    node that comes and goes."""
    listener = MetricsListener(MetricsConfig(port=0))
    try:
        url = listener.describe()["metrics_url"]
        step = {"tokens": 100, "padding_tokens": 10, "seconds": 0.5, "peak_memory_bytes": 1000,
                "predicted_memory_bytes": 1200}
        for trainer in ("trainer-0", "trainer-1"):
            status = replace(scenario.status, trainer_id=trainer, jobs=["x"])
            listener.trainer_polled(status, [TrainerEvent(kind="step", job_id="", step=1, data=step)])
        before, _ = scrape(url)
        trainers = {dict(labels).get("trainer") for _, labels in before} - {None}
        assert trainers == {"trainer-0", "trainer-1"}
        listener.trainer_retired("trainer-1")
        after, _ = scrape(url)
        assert not [(name, dict(labels)) for name, labels in after if dict(labels).get("trainer") == "trainer-1"]
        assert {key: v for key, v in before.items() if dict(key[1]).get("trainer") == "trainer-0"} == {
            key: v for key, v in after.items() if dict(key[1]).get("trainer") == "trainer-0"}
        assert value(after, "aspen_trainer_jobs", trainer="trainer-0") == 1
    finally:
        listener.close()


def test_a_taken_port_is_logged_with_the_fix_and_the_service_runs_on(caplog, scenario):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="orchestrator.metrics"):
            listener = MetricsListener(MetricsConfig(port=port))
        try:
            (error,) = listener.describe().values()
            assert f"127.0.0.1:{port}" in error and "metrics.port" in error
            listener.trainer_polled(scenario.status, [])     # still collects, without a page
            listener.tick(scenario.table.all(), scenario.table.counts(), [scenario.status])
        finally:
            listener.close()
    message = caplog.text
    assert f"127.0.0.1:{port}" in message and "metrics.port" in message and "0 = any free port" in message


def test_service_listeners_serve_metrics_only_when_enabled(tmp_path):
    (listener,) = service_listeners(ServiceConfig(state_dir=tmp_path, metrics=MetricsConfig(port=0),
                                                  events=EventsConfig(enabled=False)))
    try:
        url = listener.describe()["metrics_url"]
        port = int(re.fullmatch(r"http://127\.0\.0\.1:(\d+)/metrics", url).group(1))
        assert port > 0
        samples, _ = scrape(url)
        assert series(samples, "aspen_build_info")
    finally:
        listener.close()
    assert service_listeners(ServiceConfig(state_dir=tmp_path, metrics=MetricsConfig(enabled=False),
                                           events=EventsConfig(enabled=False))) == []


def test_every_metric_family_is_in_the_monitoring_docs_table():
    """docs/monitoring.md's table names every family the service registers (the sweeps' two were missing), with
    its labels as the registry has them."""
    from pathlib import Path

    listener = MetricsListener(MetricsConfig(enabled=True, port=0), serve=False)
    documented = dict(re.findall(r"^\| `(aspen_[a-z_]+)(?:\{([a-z_,]*)\})?` \|",
                                 (Path(__file__).resolve().parents[3] / "docs" / "monitoring.md").read_text(), re.M))
    for metric in listener.registry.collect():
        name = metric.name + ("_total" if metric.type == "counter" else "")
        labels = {label for sample in metric.samples for label in sample.labels if label != "le"}
        assert name in documented, f"{name} is not in docs/monitoring.md's table"
        assert not labels or set(documented[name].split(",")) == labels, (name, labels, documented[name])
