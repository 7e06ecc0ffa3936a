"""The service's background processes step aside for the trainers on every thread, as the kernel reports
it (/proc/PID/task/TID/stat), not as our own code remembers it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.niceness import BACKGROUND_NICENESS, LOWEST_NICENESS

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys, threading, time
from actors.niceness import background_priority, lowest_priority
started = threading.Event()
threading.Thread(target=lambda: (started.set(), time.sleep(60)), daemon=True).start()   # before, as Ray's are
started.wait()
background_priority()
threading.Thread(target=lambda: time.sleep(60), daemon=True).start()                      # after: inherits
print("ready", flush=True)
sys.stdin.readline()
lowest_priority()
print("lowest", flush=True)
sys.stdin.readline()
"""

SCHED_OTHER = 0   # linux/sched.h



def kernel_policies(pid: int) -> dict[int, tuple[int, int]]:
    """(scheduling policy, nice) of each thread of `pid`, from /proc/PID/task/TID/stat (fields 41 and 19; field 3 is
    the first after the name)."""
    result = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        result[int(task.name)] = (int(fields[38]), int(fields[16]))
    return result


def may_lower_niceness() -> bool:
    """Whether this process may lower a niceness (root, or CAP_SYS_NICE: bit 23 of its effective set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 23 & 1)
    return os.geteuid() == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness and /proc are Linux's")
@pytest.mark.parametrize("started_at", [0, 15], ids=["nice-0", "ray-default-nice-15"])
def test_background_and_lowest_priority_reach_threads_started_before_and_after(started_at):
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             preexec_fn=lambda: os.nice(started_at))
    try:
        assert child.stdout.readline().strip() == "ready"
        policies = kernel_policies(child.pid)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "lowest"
        lowest = kernel_policies(child.pid)
    finally:
        child.communicate("\n", timeout=30)
    assert len(policies) >= 3
    # from Ray's default 15 the scheduler comes down to 10 where the process may lower its niceness
    background = BACKGROUND_NICENESS if started_at <= BACKGROUND_NICENESS or may_lower_niceness() else started_at
    assert all(nice == background and policy == SCHED_OTHER for policy, nice in policies.values()), policies
    assert lowest.keys() == policies.keys() and all(policy == SCHED_OTHER and nice == LOWEST_NICENESS
                                                    for policy, nice in lowest.values()), lowest
    mine = kernel_policies(os.getpid())
    assert all(nice < BACKGROUND_NICENESS for _, nice in mine.values())   # only the process that asked steps aside
