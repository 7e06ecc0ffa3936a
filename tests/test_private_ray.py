"""The private Ray cluster of `Client.local`: its unused daemons are stopped, the raylet's memory watch is
slowed, and the cluster still runs actors. Checked on the real processes of a cluster started in a child
process (the test session's own Ray stays as it is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os
import ray
from orchestrator.client import ensure_ray

ensure_ray(num_cpus=1, object_store_memory=80 * 2**20)
session = ray._private.worker._global_node.get_session_dir_path()

@ray.remote(num_cpus=0)
class Echo:
    def pid(self):
        return os.getpid()

actor_pid = ray.get(Echo.remote().pid.remote(), timeout=120)
processes = {}
for entry in os.listdir("/proc"):
    if not entry.isdigit():
        continue
    try:
        cmdline = open(f"/proc/{entry}/cmdline", "rb").read().decode(errors="replace").replace("\0", " ")
        environ = open(f"/proc/{entry}/environ", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        continue
    if session in cmdline:
        processes[entry] = {"cmdline": cmdline, "environ": [e for e in environ if e.startswith("RAY_memory")]}
print(json.dumps({"actor_pid": actor_pid, "processes": processes}))
ray.shutdown()
"""


def test_private_cluster_runs_without_log_and_autoscaler_monitors():
    env = {key: value for key, value in __import__("os").environ.items()
           if key not in ("RAY_ADDRESS", "RAY_memory_monitor_refresh_ms")}
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["actor_pid"] > 0
    commands = [p["cmdline"] for p in report["processes"].values()]
    raylets = [p for p in report["processes"].values() if "/raylet/raylet " in p["cmdline"]]
    assert len(raylets) == 1 and any("gcs_server" in c for c in commands), commands
    assert not any("log_monitor.py" in c for c in commands), commands
    assert not any("autoscaler/_private/monitor.py" in c for c in commands), commands
    assert raylets[0]["environ"] == ["RAY_memory_monitor_refresh_ms=1000"]
