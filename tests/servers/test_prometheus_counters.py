"""Counters as a real Prometheus (the `prometheus` binary, scraping every second) reads them: a job's
`aspen_job_tokens_total` across a pause and a resume from an earlier checkpoint (its `tokens` restart at the
checkpoint's count) and across a restart of the service's process (a new endpoint on the same port) never goes
down, which Prometheus would read as a counter reset (`resets()`), counting the whole value again in `rate()` and
`increase()`; nor do a user's counters when one of their jobs is deleted (its usage leaves their account) and
the service restarts. The `MetricsListener` is driven as the scheduler drives it: with job records, and with the
usage rows of a real job table."""

from __future__ import annotations

import time
from dataclasses import replace

from actors.service.scheduler.config import MetricsConfig
from actors.service.table.job_table import JobRecord
from orchestrator.metrics import MetricsListener
from tests.helpers.metrics_scenario import scrape
from tests.helpers.ports import free_port
from tests.helpers.scheduler_fakes import running_jobs
from tests.helpers.service import wait_for
from tests.servers.test_prometheus_grafana import number, prometheus_binary, prometheus_server, query

RUNNING = JobRecord(id="job-1", name="long", state="running", reason="", base_model="tiny", quantization="none",
                    priority=0, output_dir="/tmp/out/long", trainer="trainer-0", step=10, total_steps=100,
                    tokens=1000, loss=1.0, eval_loss=None, tokens_per_s=100.0, checkpoint_step=5, adapter_dir=None,
                    submitted_at=time.time(), started_at=time.time(), finished_at=None, updated_at=time.time(),
                    account_tokens=1000)
SERIES = 'aspen_job_tokens_total{job_id="job-1"}'


def test_a_jobs_token_counter_never_goes_down_across_a_resume_and_a_restart(tmp_path):
    binary = prometheus_binary()
    port = free_port()
    listener = MetricsListener(MetricsConfig(port=port))
    try:
        with prometheus_server(binary, f"127.0.0.1:{port}", tmp_path / "prometheus") as prometheus:
            def scraped() -> float:
                """The job's counter on the page (its exposition text), once Prometheus has read that value."""
                value = page()
                wait_for(lambda: number(prometheus, SERIES) == value, timeout=20, what=f"Prometheus to read {value}")
                return value

            def page() -> float:
                return scrape(listener.url)[0][("aspen_job_tokens_total", frozenset({("job_id", "job-1")}))]

            listener.tick([RUNNING], {"running": 1}, [])
            assert scraped() == 1000
            paused = replace(RUNNING, state="paused")          # `aspen pause`, a preemption: its series go
            listener.job_changed(paused, "running")
            wait_for(lambda: not query(prometheus, SERIES), timeout=20, what="the paused job's series to go")
            # resumed from its checkpoint at step 5: `tokens` is the checkpoint's count again, its account is not
            resumed = replace(RUNNING, step=5, tokens=500)
            listener.tick([resumed], {"running": 1}, [])
            listener.tick([replace(resumed, step=6, tokens=600, account_tokens=1100)], {"running": 1}, [])
            before = scraped()
            listener.close()                                    # the service's process restarts
            listener = MetricsListener(MetricsConfig(port=port))
            listener.tick([replace(resumed, step=6, tokens=600, account_tokens=1100)], {"running": 1}, [])
            assert page() >= before                             # the exposition text itself
            listener.tick([replace(resumed, step=7, tokens=700, account_tokens=1200)], {"running": 1}, [])
            scraped()
            samples = [float(v) for _, v in query(prometheus, f"{SERIES}[5m]")[0]["values"]]
            assert number(prometheus, f"resets({SERIES}[5m])") == 0, samples
            assert samples == sorted(samples) and samples[0] == 1000 and samples[-1] == 1200, samples
            # what Prometheus takes the job to have trained in the window: what it did (no reset counted twice)
            assert number(prometheus, f"max_over_time({SERIES}[5m]) - min_over_time({SERIES}[5m])") == 200
    finally:
        listener.close()


def test_a_users_counters_never_go_down_when_a_job_is_deleted_and_the_service_restarts(tmp_path):
    binary = prometheus_binary()
    table, _, (first, second) = running_jobs(tmp_path)   # jobs through Ray: user ""
    table.usage.add(first, 1000, 2.0, 0.0)
    table.usage.add(second, 100, 0.5, 0.0)
    tokens = 'aspen_user_trained_tokens_total{user=""}'
    port = free_port()
    listener = MetricsListener(MetricsConfig(port=port))
    try:
        with prometheus_server(binary, f"127.0.0.1:{port}", tmp_path / "prometheus") as prometheus:
            def scraped() -> float:
                """The user's token counter on the page, once Prometheus has read that value."""
                value = scrape(listener.url)[0][("aspen_user_trained_tokens_total", frozenset({("user", "")}))]
                wait_for(lambda: number(prometheus, tokens) == value, timeout=20, what=f"Prometheus to read {value}")
                return value

            listener.accounts(table.usage.ever_used())   # what the scheduler actor hands its listeners each round
            assert scraped() == 1100
            table.delete(first)                          # `aspen run --overwrite`, `client.delete`
            assert table.usage.accounts()[None]["tokens"] == 100   # its usage left the account
            table.usage.add(second, 50, 0.25, 0.0)
            listener.accounts(table.usage.ever_used())
            assert scraped() == 1150                     # the 50 trained since count (not swallowed by the fall)
            listener.close()                             # the service's process restarts on the same table
            listener = MetricsListener(MetricsConfig(port=port))
            listener.accounts(table.usage.ever_used())
            assert scraped() == 1150
            samples = [float(v) for _, v in query(prometheus, f"{tokens}[5m]")[0]["values"]]
            assert number(prometheus, f"resets({tokens}[5m])") == 0, samples
            assert number(prometheus, f"max_over_time({tokens}[5m]) - min_over_time({tokens}[5m])") == 50
            seconds = scrape(listener.url)[0][("aspen_user_step_seconds_total", frozenset({("user", "")}))]
            assert seconds == 2.75
    finally:
        listener.close()
        table.close()
