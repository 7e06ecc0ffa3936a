"""A step's allocation peak as torch.profiler's memory timeline counts it (the reference)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def profiler_peak(run) -> int:
    """Peak growth of live CPU allocations while `run()` runs: the profiler's raw memory records (one per
    allocation and free, with its bytes and time), summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in records:
        live += nbytes
        peak = max(peak, live)
    return peak
