"""Policies driving real runs on the local Ray: a third-party policy found by its entry point drives a
run (its limit of two jobs per trainer holds in every fused step)."""

from __future__ import annotations

import json
import time
from pathlib import Path


from actors.core.config import ServiceConfig, TrainerConfig
from orchestrator.client import Client
from tests.service_helpers import job_dict, run_spec, write_task_data

def wait_for(predicate, timeout: float = 120, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def step_rows(state_dir: Path) -> list[dict]:
    path = state_dir / "trainers" / "trainer-0.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_a_policy_found_by_entry_point_drives_a_run(ray_session, tiny_model_dirs, tmp_path):
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    config = ServiceConfig(state_dir=tmp_path / "state", policy="fixed-concurrency", tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1)])
    spec = run_spec(base, tmp_path / "out", [job_dict(f"j{i}", write_task_data(data, f"j{i}"), 15) for i in range(3)],
                    step_tokens=512)
    client = Client.local(config)
    try:
        assert client.info()["policy"] == "fixed-concurrency"
        handles = client.submit_run(spec)
        records = client.wait_all([h.id for h in handles], timeout=180)
        assert all(r.state == "completed" for r in records)
        ids = [h.id for h in handles]
    finally:
        client.shutdown()
    rows = step_rows(tmp_path / "state")
    assert max(len(r["jobs"]) for r in rows) == 2                  # the plug-in's limit held
    assert {j for r in rows for j in r["jobs"]} == set(ids)
