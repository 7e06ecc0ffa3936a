"""The metrics endpoint and the Grafana dashboards against a real Prometheus server (the `prometheus`
binary; Debian package `prometheus`): a real service run on a tiny model is scraped every second, every
query of the dashboards (their panels and their query variables) returns data, and Prometheus' totals
agree with the trainer's own step log. Without the binary the test skips, except under CI (`CI=true`),
where it fails."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest

from actors.service.scheduler.config import MetricsConfig, ServiceConfig, TrainerConfig
from orchestrator.client import Client
from tests.helpers.prometheus import number, prometheus_binary, prometheus_server, query
from tests.helpers.service import job_dict, run_spec, wait_for, write_task_data

DASHBOARDS = Path(__file__).resolve().parents[2] / "grafana" / "dashboards"
GRAFANA_INTERVALS = {"$__rate_interval": "30s", "$__range": "5m", "$__interval": "5s"}


def dashboard_queries() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Every panel target of every dashboard as (panel title, PromQL with Grafana's variables filled in:
    intervals by fixed durations, the dashboard's query variables by `.*`), and every query variable's
    `label_values(metric, label)` (the `datasource` variable picks the Prometheus: here, this one)."""
    panels, labels = [], []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        variables = [v for v in board["templating"]["list"] if v["type"] != "datasource"]
        substitutions = {**GRAFANA_INTERVALS, **{f"${v['name']}": ".*" for v in variables}}
        for panel in board["panels"]:
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", (path.name, panel["title"])
                expression = target["expr"]
                for name in sorted(substitutions, key=len, reverse=True):
                    expression = expression.replace(name, substitutions[name])
                assert "$" not in expression, (path.name, panel["title"], expression)
                panels.append((f"{path.name}: {panel['title']}", expression))
        for variable in variables:
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
            assert match, (path.name, variable)
            labels.append((f"{path.name}: {variable['name']}", match.group(1), match.group(2)))
    assert panels and labels
    return panels, labels


def test_every_dashboard_query_has_data_in_a_real_prometheus(ray_session, tiny_model_dirs, tmp_path):
    binary = prometheus_binary()
    base = str(tiny_model_dirs["llama"])
    trainer = TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1, max_jobs=1)
    config = ServiceConfig(state_dir=tmp_path / "state", trainers=[trainer], tick_seconds=0.1,
                           metrics=MetricsConfig(port=0))
    client = Client.local(config)
    try:
        metrics_url = client.info()["metrics_url"]
        target = re.fullmatch(r"http://(127\.0\.0\.1:\d+)/metrics", metrics_url).group(1)
        with prometheus_server(binary, target, tmp_path / "prometheus") as prometheus:
            wait_for(lambda: number(prometheus, 'up{job="aspen"}') == 1, timeout=30,
                     what="prometheus to scrape the service")
            data = tmp_path / "data"
            # entered in one transaction, both are decided in one round: the short one starts, the long one
            # waits for the one slot (cause `slots`) whatever the machine's speed, then runs
            short, long = client.submit_run(run_spec(base, tmp_path / "out", [
                job_dict("short", write_task_data(data, "short"), 4),
                job_dict("long", write_task_data(data, "long", offset=3), 5000)], step_tokens=512))
            wait_for(lambda: short.status().state == "completed" and long.status().step >= 3, timeout=120,
                     what="the short job to complete and the long one to train")
            panels, variables = dashboard_queries()

            def empty() -> list[tuple[str, str]]:
                """Queries without a finite number in their result (quantiles are NaN until the
                rate window holds two scrapes of a changed histogram). The series of grpo and preference
                jobs only are left out: this scenario's jobs are sft jobs (their values are checked through
                a trainer loop's events in tests/unit/service/test_progress_metrics.py)."""
                return [(title, expression) for title, expression in panels
                        if not re.search(r"\baspen_job_reward(_margin)?\b", expression)
                        and not any(math.isfinite(float(r["value"][1])) for r in query(prometheus, expression))]

            deadline = time.time() + 40
            while (missing := empty()) and time.time() < deadline:
                time.sleep(1)
            assert not missing, missing
            for name, metric, label in variables:
                values = {r["metric"].get(label) for r in query(prometheus, metric)}
                assert values and None not in values, (name, metric, label)
            assert {r["metric"]["job_id"] for r in query(prometheus, "aspen_job_loss")} == {long.id}
            assert number(prometheus, f'aspen_job_tokens_total{{job_id="{long.id}"}}') > 0
            assert number(prometheus, f'resets(aspen_job_tokens_total{{job_id="{long.id}"}}[1m])') == 0

            client.cancel(long.id)
            assert long.wait(timeout=60).state == "cancelled"
            rows = [json.loads(line) for line in (tmp_path / "state/trainers/trainer-0.jsonl").read_text().splitlines()]
            wait_for(lambda: number(prometheus, "sum(aspen_trainer_steps_total)") == len(rows), timeout=20,
                     what="Prometheus' step count to reach the trainer's step log")
            assert number(prometheus, "sum(aspen_tokens_total)") == sum(row["tokens"] for row in rows)
            assert number(prometheus, 'aspen_tokens_total{kind="padding"}') == sum(r["padding_tokens"] for r in rows)
            wait_for(lambda: not query(prometheus, "aspen_job_loss"), timeout=20, what="the job's series to go")
            assert not query(prometheus, "aspen_job_tokens_total")
            # the per-state gauges follow at the scheduler's next decision round (a round may come less often
            # than a tick: actors/service/scheduler/scheduler_loop.py, ROUND_SHARE)
            wait_for(lambda: number(prometheus, 'aspen_jobs{state="cancelled"}') == 1, timeout=20,
                     what="the cancelled job in aspen_jobs")
            assert number(prometheus, 'aspen_jobs{state="completed"}') == 1
            assert number(prometheus, 'aspen_admissions_deferred_total{cause="slots"}') == 1
            assert number(prometheus, "aspen_queue_wait_seconds_count") == 2

            # a sweep's gauges: its trials by state and its best objective, as the service's status says
            job = {**job_dict("qa", write_task_data(data, "qa", offset=5), 3, eval_split=4, eval_every=1),
                   "checkpoint_every": 100}
            client.sweep({"name": "gauged", "base_model": base, "output_dir": str(tmp_path / "sweep"),
                          "step_tokens": 512, "job": job, "search": "grid", "space": {"lr": {"choice": [1e-3, 2e-3]}}})
            status = wait_for(lambda: (found := client.sweep_status("gauged"))["state"] == "done" and found,
                              timeout=120, what="the sweep to end")
            best = next(t["objective"] for t in status["trials"] if t["name"] == status["best"])
            wait_for(lambda: number(prometheus, 'aspen_sweep_trials{sweep="gauged",state="completed"}') == 2,
                     timeout=20, what="the sweep's trials in aspen_sweep_trials")
            assert number(prometheus, 'aspen_sweep_trials{sweep="gauged",state="stopped"}') == 0
            assert number(prometheus, 'aspen_sweep_best_objective{sweep="gauged"}') == pytest.approx(best, rel=1e-12)
    finally:
        client.shutdown()
