"""What the benchmarks say about the machine they ran on: the CPU's model and how much of the CPU other
processes took while they measured."""

from __future__ import annotations

import os
import platform
import resource
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), and the cores this process may use."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU {model}, {cores} cores available"


class CpuMonitor:
    """How much CPU other processes used while we measured: timings on a shared machine are only as good as
    this number is small (with OpenMP's spin-waiting, two busy processes on 2 cores can slow a step 10x).
    This process and its children (waited for) count as ours."""

    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        busy = (sum(values) - values[3] - values[4]) / self.tick   # all but idle and iowait
        own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for field in ("ru_utime", "ru_stime"))
        return time.monotonic(), busy, own

    def others_share(self) -> float | None:
        """Fraction of the machine's CPU capacity used by other processes since the monitor started."""
        now = self._read()
        if now is None or self.start is None or now[0] <= self.start[0]:
            return None
        others = (now[1] - self.start[1]) - (now[2] - self.start[2])
        return max(others, 0.0) / ((now[0] - self.start[0]) * self.cpus)
