"""Counters as a real Prometheus (the `prometheus` binary, scraping every second) reads them: a job's
`aspen_job_tokens_total` across a pause and a resume from an earlier checkpoint (its `tokens` restart at the
checkpoint's count) and across a restart of the service's process (a new endpoint on the same port) never goes
down, which Prometheus would read as a counter reset (`resets()`), counting the whole value again in `rate()` and
`increase()`; nor do a user's counters when one of their jobs is deleted (its usage leaves their account) and
the service restarts. The `MetricsListener` is driven as the scheduler drives it: with job records, and with the
usage rows of a real job table; and a real service on the session's Ray, whose job's actor is killed mid-run (the
job starts again from its start: no checkpoint), is scraped by a real Prometheus throughout."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from actors.service.scheduler.config import MetricsConfig
from actors.service.table.job_table import JobRecord
from orchestrator.client import Client
from orchestrator.metrics import MetricsListener
from tests.helpers.metrics_scenario import scrape
from tests.helpers.ports import free_port
from tests.helpers.prometheus import number, prometheus_binary, prometheus_server, query
from tests.helpers.scheduler_fakes import running_jobs
from tests.helpers.service import job_dict, run_spec, service_config, wait_for, write_task_data

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


@pytest.mark.long   # 50-65 s here: 2600 steps, a trainer killed and replaced, 300 more steps
def test_a_real_services_job_token_counter_never_goes_down_when_its_job_resumes(ray_session, tiny_model_dirs,
                                                                              tmp_path):
    """The trainer is killed (a lost process) some steps past the job's checkpoint: the service starts a new one,
    and the job resumes from that checkpoint, its record's `tokens` back at the checkpoint's count; the counter of
    its series, which goes while the job waits and comes back when it runs, reads on and counts what the job trains
    again (before, it stood still until the job's `tokens` passed their old high, which it came back at here: the
    first round after the restart saw the record before its started event; where that round sees the checkpoint's
    count, or a restarted service does, it came back lower: the first test's reset)."""
    ray = ray_session
    binary = prometheus_binary()
    base = tiny_model_dirs["llama"]
    listeners = {"events": {"enabled": False}, "metrics": {"port": 0}}
    client = Client.local(service_config(tmp_path / "state", base, listeners=listeners))
    try:
        target = client.info()["metrics_url"].removeprefix("http://").removesuffix("/metrics")
        with prometheus_server(binary, target, tmp_path / "prometheus") as prometheus:
            # the trainer runs up to a few hundred steps ahead of its reports in the table (6-40 ms a step here):
            # killed once the table is 600 steps past the checkpoint at 2000, it has not reached the next one
            job = job_dict("long", write_task_data(tmp_path / "data", "long"), 8000, checkpoint_every=2000)
            (long,) = client.submit_run(run_spec(str(base), tmp_path / "out", [job], step_tokens=512))
            series = f'aspen_job_tokens_total{{job_id="{long.id}"}}'
            wait_for(lambda: long.status().step >= 2600, timeout=300, what="the job to pass its checkpoint at 2000")
            first = long.status()
            wait_for(lambda: (number(prometheus, series) or 0) >= first.tokens, timeout=20,
                     what="Prometheus to read the job's tokens past its checkpoint")
            before = long.status()
            seen = number(prometheus, series)
            ray.kill(ray.get_actor(client.trainers()[0]["actor_name"]))
            wait_for(lambda: any("was lost" in r for _, _, r in client.transitions(long.id)), timeout=60,
                     what="the job to lose its trainer")
            lost = long.status()                              # at the last step its trainer reported
            # running again from its checkpoint: its record's count restarted lower, then 30 steps trained since
            # (its started event booked: until then the record is the one before the loss, at its last step), and
            # 300 steps past where it was lost: what it trained again is more than it had trained past its checkpoint
            resumed = wait_for(lambda: (s := long.status()).state == "running" and "resumed from step" in s.reason
                               and s.step >= lost.step + 300 and s, timeout=180, what="the job to train again",
                               state=long.status)
            assert resumed.checkpoint_step == 2000 < before.step    # its `tokens` went back at the resume
            # what it trained again since (the reference: its own step rows, those to its checkpoint kept)
            again = resumed.tokens - sum(row["tokens"] for row in long.losses() if row["step"] <= 2000)
            assert again > 0
            time.sleep(2.2)                                   # two more scrapes, both after `resumed` was read
            # tokens trained again count again: every value since is at least what it had before and those
            after = number(prometheus, f"min_over_time({series}[2s])")
            assert after >= seen + again, (after, seen, again)
            samples = [float(v) for _, v in query(prometheus, f"{series}[5m]")[0]["values"]]
            assert number(prometheus, f"resets({series}[5m])") == 0, samples
            assert samples == sorted(samples), samples
    finally:
        client.shutdown()
