"""The service's background processes step aside for the trainers on every thread, as the kernel reports
it (/proc/PID/task/TID/stat), not as our own code remembers it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.niceness import BACKGROUND_NICENESS

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys, threading, time
from actors.niceness import background_priority, idle_priority
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(60)), daemon=True).start()   # before, as Ray's are
started.wait()
background_priority()
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()                      # after: inherits
print("ready", flush=True)
sys.stdin.readline()
idle_priority()
print("idle", flush=True)
sys.stdin.readline()
"""

SCHED_OTHER, SCHED_IDLE = 0, 5   # linux/sched.h



def kernel_policies(pid: int) -> dict[int, tuple[int, int]]:
    """(scheduling policy, nice) of each thread of `pid`, from /proc/PID/task/TID/stat (fields 41 and 19; field 3 is
    the first after the name)."""
    result = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        result[int(task.name)] = (int(fields[38]), int(fields[16]))
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness and /proc are Linux's")
def test_background_and_idle_priority_reach_threads_started_before_and_after():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout.readline().strip() == "ready"
        policies = kernel_policies(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "idle"
        idle = kernel_policies(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert len(policies) >= 3
    assert all(nice == BACKGROUND_NICENESS and policy == SCHED_OTHER for policy, nice in policies.values()), policies
    assert idle.keys() == policies.keys() and all(policy == SCHED_IDLE for policy, _ in idle.values()), idle
    mine = kernel_policies(os.getpid())
    assert all(nice < BACKGROUND_NICENESS for _, nice in mine.values())   # only the process that asked steps aside
