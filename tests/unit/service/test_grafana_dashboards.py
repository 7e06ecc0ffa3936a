"""The Grafana dashboards (grafana/) against the service's Prometheus endpoint (the `scenario` fixture's
`/metrics` page, tests/helpers/metrics_scenario.py): the dashboards only name metrics that exist, graph counters
by their rate, pick their data source with a variable, and are provisioned with a default Prometheus data source
they do not depend on. The endpoint itself: test_metrics_endpoint.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
GRAFANA = REPO / "grafana"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
COUNTER_CALLS = ("rate", "increase")   # a graph of a counter shows how fast it grows, not its running total


def dashboards() -> dict[str, dict]:
    boards = {path.name: json.loads(path.read_text()) for path in sorted((GRAFANA / "dashboards").glob("*.json"))}
    assert "aspen.json" in boards
    return boards


def values_of(key: str, node, where: str = "") -> Iterator[tuple[str, object]]:
    """Every value of `key` anywhere in a dashboard, with where it is."""
    if isinstance(node, dict):
        for name, item in node.items():
            if name == key:
                yield f"{where}.{key}", item
            yield from values_of(key, item, f"{where}.{name}")
    elif isinstance(node, list):
        for index, item in enumerate(node):
            yield from values_of(key, item, f"{where}[{index}]")


METHOD_GAUGES = {"aspen_job_reward", "aspen_job_reward_margin"}
"""Series of grpo and preference jobs only, which the scenario's sft jobs do not have: declared gauges all the same."""


def test_every_dashboard_only_names_metrics_the_service_exports(scenario):
    during, families = scenario.during
    declared = {family.name: family.type for family in scenario.listener.registry.collect()}
    assert all(declared.get(name) == "gauge" for name in METHOD_GAUGES), declared
    families = {**families, **{name: (name, "gauge") for name in METHOD_GAUGES}}
    exported = {name for name, _ in during} | METHOD_GAUGES
    named = set()
    for name, board in dashboards().items():
        panels = board["panels"]
        ids = [p["id"] for p in panels]
        assert len(ids) == len(set(ids)), name
        graphs = [t["expr"] for p in panels for t in p["targets"]]
        lookups = [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
        assert graphs, name
        for query in graphs + lookups:
            for metric in re.findall(r"\baspen_[a-z0-9_]+", query):
                assert metric in exported, (name, metric, query)
                named.add(metric)
                if query in lookups:   # label_values(): only its labels matter
                    continue
                if metric.endswith(("_total", "_bucket")):   # counters, and histograms' counters
                    assert re.search(rf"\b({'|'.join(COUNTER_CALLS)})\(\s*{metric}\b", query), (name, query)
                else:
                    assert families[metric][1] != "counter", (name, metric)
    assert len(dashboards()["aspen.json"]["panels"]) >= 10
    for family in ("aspen_tokens_total", "aspen_padding_ratio", "aspen_trainer_utilization_ratio",
                   "aspen_memory_in_use_bytes", "aspen_step_predicted_peak_memory_bytes", "aspen_job_loss",
                   "aspen_job_tokens_total", "aspen_job_tokens_per_second", "aspen_job_step", "aspen_jobs",
                   "aspen_preemptions_total", "aspen_admissions_deferred_total", "aspen_early_stops_total",
                   "aspen_step_duration_seconds_bucket", "aspen_queue_wait_seconds_bucket", *sorted(METHOD_GAUGES)):
        assert family in named, family


def test_every_dashboard_picks_its_data_source_with_a_variable():
    """Importing a dashboard works on any Grafana: no panel, target or variable names a data source uid;
    they all use the `datasource` variable, which offers the Prometheus data sources and opens on the
    org's default one."""
    for name, board in dashboards().items():
        assert "__inputs" not in board and "__requires" not in board, name
        variables = board["templating"]["list"]
        (variable,) = [v for v in variables if v["name"] == "datasource"]
        assert variable["type"] == "datasource" and variable["query"] == "prometheus", name
        assert variable.get("current", {}).get("value") in (None, "default"), name   # no fixed uid
        for other in variables:
            if other is not variable:
                assert other["datasource"] == DATASOURCE, (name, other["name"])
        for panel in board["panels"]:
            assert panel["datasource"] == DATASOURCE, (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"] == DATASOURCE, (name, panel["title"], target["refId"])
        # nothing else names a data source or a uid (but the dashboard's own uid, at the top)
        assert [(where, ds) for where, ds in values_of("datasource", board) if ds != DATASOURCE] == [], name
        uids = [(where, uid) for where, uid in values_of("uid", board) if where != ".uid"]
        assert uids and {uid for _, uid in uids} == {"${datasource}"}, (name, uids)


def test_the_dashboards_are_provisioned_with_a_default_data_source_they_pick():
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    (source,) = sources
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"
    assert source["isDefault"] is True     # what each dashboard's `datasource` variable opens on
    for name, board in dashboards().items():
        assert source["uid"] not in json.dumps(board), name   # the dashboards do not depend on it
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/aspen.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    provisioning = GRAFANA / "provisioning"   # what GF_PATHS_PROVISIONING points at
    path = Path(provider["options"]["path"].replace("${GF_PATHS_PROVISIONING}", str(provisioning))).resolve()
    assert path == (GRAFANA / "dashboards").resolve() and (path / "aspen.json").is_file()
