"""The private Ray cluster of `Client.local`: its unused daemons are stopped, Ray's processes run with the
quiet settings (memory watch slowed, no task events, no Ray metrics, ...) while the driver's own environment
is left as it was, and the cluster still runs actors and tasks. Checked on the real processes of a cluster
started in a child process (the test session's Ray is started the same way, by tests/conftest.py, so every
service test runs on such a cluster)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os
import ray
from orchestrator.ray_cluster import ensure_ray
from orchestrator.private_ray import QUIET_SETTINGS

before = {name: os.environ.get(name) for name in QUIET_SETTINGS}
ensure_ray(num_cpus=1, object_store_memory=80 * 2**20)
after = {name: os.environ.get(name) for name in QUIET_SETTINGS}
session = ray._private.worker._global_node.get_session_dir_path()

@ray.remote(num_cpus=0)
class Echo:
    def pid(self):
        return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)

@ray.remote(num_cpus=0)
def square(x):
    return x * x

actor_pid, actor_nice = ray.get(Echo.remote().pid.remote(), timeout=120)
squares = ray.get([square.remote(i) for i in range(4)], timeout=120)
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
        settings = dict(e.split("=", 1) for e in environ if e.split("=", 1)[0] in QUIET_SETTINGS)
        processes[entry] = {"cmdline": cmdline, "settings": settings}
print(json.dumps({"actor_pid": actor_pid, "actor_nice": actor_nice, "squares": squares, "processes": processes,
                  "before": before, "after": after, "quiet": QUIET_SETTINGS}))
ray.shutdown()
"""


def test_private_cluster_runs_quietly_and_leaves_the_driver_environment_alone():
    from orchestrator.private_ray import QUIET_SETTINGS

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS" and key not in QUIET_SETTINGS}
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["actor_pid"] > 0 and report["squares"] == [0, 1, 4, 9]
    assert report["actor_nice"] == 0   # Ray's workers start at normal priority (its default is 15)
    processes = list(report["processes"].values())
    commands = [p["cmdline"] for p in processes]
    daemons = [p for p in processes if "/raylet/raylet " in p["cmdline"] or "/gcs/gcs_server " in p["cmdline"]]
    agents = [p for p in processes if "dashboard/agent.py" in p["cmdline"]]
    assert len(daemons) == 2 and len(agents) == 1, commands
    assert not any("log_monitor.py" in c for c in commands), commands
    assert not any("autoscaler/_private/monitor.py" in c for c in commands), commands
    assert not any("dashboard/dashboard.py" in c for c in commands), commands
    for process in daemons + agents:   # Ray's processes got every setting ...
        assert process["settings"] == report["quiet"], process
    # ... and the driver's environment is as it was before ray.init (none of them was set)
    assert report["before"] == report["after"] == {name: None for name in report["quiet"]}
