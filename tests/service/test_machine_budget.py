"""A service YAML whose trainer memory budget is larger than the machine: `aspen serve` on this machine's cluster
started the service, and only placement said, later, that no node of the cluster has that memory. Now the real CLI
refuses it before joining Ray, naming the file, the field, the machine's memory (psutil's, the reference) and the fix;
a budget that fits still starts the service."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil

from orchestrator.client import Client
from orchestrator.errors import ServiceError


def _serve(folder, budget: int, *args: str) -> subprocess.CompletedProcess:
    (folder / "service.yaml").write_text(json.dumps({
        "state_dir": str(folder / "state"), "cluster_poll_s": 1.0, "tick_seconds": 0.1,
        # a kind no node of the test cluster holds (64 CPUs): the service starts with no trainer to load
        "trainers": [{"nodes": "each", "num_cpus": 64, "memory_budget_bytes": budget}]}))
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--config", "service.yaml", *args],
                          cwd=folder, capture_output=True, text=True, timeout=300, env=env)


def test_aspen_serve_refuses_a_budget_over_the_machines_memory_before_joining_ray(tmp_path):
    total = psutil.virtual_memory().total
    served = _serve(tmp_path, 10 * total)
    assert served.returncode != 0, served.stdout
    said = served.stderr.strip().splitlines()[-1]
    assert said.startswith(f"aspen serve: service.yaml: trainers[0].memory_budget_bytes is {10 * total} "), said
    assert f"more than this machine's memory ({total / 2**30:.1f} GiB, {total} bytes)" in said, said
    assert f"Set it below {total}" in said and "RAY_ADDRESS" in said, said
    assert "Traceback" not in served.stderr and "aspen: using" not in served.stderr, served.stderr   # Ray not joined
    assert not (tmp_path / "state").exists()   # nothing started


def test_aspen_serve_with_a_budget_that_fits_the_machine_still_starts(ray_session, tmp_path):
    address = ray_session.get_runtime_context().gcs_address   # this machine's cluster, named by its address
    try:
        served = _serve(tmp_path, psutil.virtual_memory().total // 10, "--address", address, "--insecure")
        assert served.returncode == 0, served.stderr[-3000:]
        assert "aspen service running" in served.stdout, served.stdout
        assert Client.connect(address).info()["state_dir"] == str((tmp_path / "state").resolve())
    finally:
        try:
            Client.connect(address).shutdown()
        except ServiceError:
            pass   # it did not start
