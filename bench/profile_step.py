"""Where a training step's time goes: a few steps under torch.profiler, summarised as the top kernels by GPU
time (share, ms a step, calls a step), kernel launches and host-device synchronisations a step, and the GPU's
busy share (the union of its kernels' and copies' intervals) of the unprofiled median step and of the
profiled span. Writes the profiler's tables (by device time, by self CPU time), a gzipped Chrome trace
(chrome://tracing, Perfetto) and summary.json into the output folder.

bench/lora_mfu.py's sides call `profile_steps` after their timed steps (`--profile DIR`: aspen's fused step and
the frozen base's). Aspen's side alone, profiled:

    python bench/lora_mfu.py --parts mfu --sides aspen --steps 4 --profile DIR [--shapes llama-3.1-8b]
    python bench/lora_mfu.py --parts mfu --sides aspen --shapes tiny --device cpu --steps 4 --profile DIR
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
# the runtime calls that wait for the device, and the operators that read a device value on the host
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense", "aten::nonzero")


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length (µs in, s out) of the union of intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


def summarise(prof, steps: int, median_step_s: float | None, own_syncs: int = 1) -> dict:
    """The profile's figures per step. `own_syncs`: the synchronisations the profiling itself added."""
    from torch.autograd import DeviceType
    events = list(prof.events())
    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in device_events:
        by_name[event.name].append(event.time_range.elapsed_us() / 1e6)
    device_total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:25]
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        if event.device_type != DeviceType.CUDA and event.name in (*LAUNCHES, *SYNCS):
            counts[event.name] += 1
    syncs = sum(counts[name] for name in SYNCS) - own_syncs
    summary: dict = {"steps": steps, "device_events": len(device_events),
                     "kernels_per_step": round(sum(1 for e in device_events if "Memcpy" not in e.name
                                                   and "Memset" not in e.name) / steps, 1),
                     "launches_per_step": round(sum(counts[n] for n in LAUNCHES) / steps, 1),
                     "syncs_per_step": round(max(syncs, 0) / steps, 1),
                     "sync_calls": {n: counts[n] for n in SYNCS if counts[n]},
                     "kernel_s_per_step": round(device_total / steps, 5) if device_events else None}
    if device_events:
        intervals = [(e.time_range.start, e.time_range.end) for e in device_events]
        busy = _union_seconds(intervals) / steps
        cpu_starts = [e.time_range.start for e in events if e.device_type != DeviceType.CUDA]
        span = (max(end for _, end in intervals) - min(cpu_starts + [s for s, _ in intervals])) / 1e6
        summary.update(gpu_busy_s_per_step=round(busy, 5), gpu_busy_of_profiled_span=busy * steps / span,
                       gpu_busy_of_unprofiled_step=busy / median_step_s if median_step_s else None)
        summary["top_kernels"] = [{"name": name, "share": sum(times) / device_total,
                                   "seconds_per_step": sum(times) / steps, "calls_per_step": len(times) / steps}
                                  for name, times in top]
        summary["seconds_per_step_by_name"] = {name: round(sum(times) / steps, 7) for name, times in by_name.items()}
    else:   # a CPU: the operators by self time
        averages = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1
        summary["top_kernels"] = [{"name": e.key, "share": e.self_cpu_time_total / total,
                                   "seconds_per_step": e.self_cpu_time_total / 1e6 / steps,
                                   "calls_per_step": e.count / steps} for e in averages]
        summary["seconds_per_step_by_name"] = {e.key: round(e.self_cpu_time_total / 1e6 / steps, 7)
                                               for e in prof.key_averages() if e.self_cpu_time_total}
    return summary


def profile_steps(step: Callable[[], object], device: torch.device, steps: int, out: Path | str,
                  median_step_s: float | None = None, trace: bool = True) -> dict:
    """Run `step` `steps` times under torch.profiler (one synchronisation at the end) and write the tables, the
    trace (unless not `trace`: the export takes seconds on a large step) and summary.json into `out`; the
    summary."""
    from torch.profiler import ProfilerActivity, profile
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities, record_shapes=False) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    averages = prof.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    (out / "by_device.txt").write_text(averages.table(sort_by=sort, row_limit=40, max_name_column_width=90))
    (out / "by_cpu.txt").write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                   max_name_column_width=90))
    summary = summarise(prof, steps, median_step_s, own_syncs=1 if device.type == "cuda" else 0)
    summary.update(profiled_wall_s=round(wall, 4), out=str(out))
    if trace:
        path = out / "trace.json"
        prof.export_chrome_trace(str(path))
        with path.open("rb") as source, gzip.open(out / "trace.json.gz", "wb") as target:
            shutil.copyfileobj(source, target)
        path.unlink()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def growth(fewer: dict, more: dict, top: int = 12) -> dict:
    """Where a step's time grew between two profiles of it (two summaries: e.g. 1 and 32 fused adapters at equal
    tokens): the kernels (on a CPU: operators) whose time a step grew most, each with its seconds a step in both,
    and the step's kernel time, GPU busy time, kernels and launches in both."""
    before, after = fewer.get("seconds_per_step_by_name", {}), more.get("seconds_per_step_by_name", {})
    names = sorted(before.keys() | after.keys(), key=lambda n: before.get(n, 0.0) - after.get(n, 0.0))
    totals = {key: [fewer.get(key), more.get(key)] for key in (
        "kernel_s_per_step", "gpu_busy_s_per_step", "kernels_per_step", "launches_per_step", "syncs_per_step")}
    return {"totals": totals,
            "grew_most": [{"name": name[:120], "seconds_per_step": [before.get(name, 0.0), after.get(name, 0.0)],
                           "grew_s": round(after.get(name, 0.0) - before.get(name, 0.0), 7)} for name in names[:top]]}
