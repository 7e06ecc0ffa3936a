#!/usr/bin/env python
"""Read a GPU profile's kernels against the recorded operations that launched them, and write the
calibration: the card's profile-measured parameters, the host's costs and the measured GPU time by category.

    python bench/gpu_cost/profile_fit.py TRACE.json.gz --checkout PATH [--steps 6,7] [--out calibration.json]

TRACE: a torch.profiler Chrome trace of profile_step.py (../shared/gpu/profile_step.py: steps `--steps` of
bench/lora_mfu.py's 4 jobs, each followed by a synchronisation), made by the code of the checkout PATH (for
2026-11-28: 70c0645). The same steps are recorded here on the virtual device with that checkout, and the two
operation sequences are aligned by operation name (difflib; CUDA's own sub-operations of an index_put and a
few names that differ between torch versions are folded), so that every profiled kernel is paired with the
shapes, bytes and FLOPs of the operation that launched it. Then, class by class, each parameter is the one
that reproduces its class's total kernel time (not the step's time):

- kernel_floor: the median time of the kernels that move under 64 KiB; launch_gap: the median gap between
  consecutive kernels on the GPU where the second was queued before the first ended (elsewhere the gap is the
  host's lateness: a host-bound step's median gap was 7.8 µs, 2026-12-04);
- vectorised / generic / transposed: the class's bytes over its time less the floors, as a share of HBM's;
- fp32_skinny / bf16_skinny: float32 / bf16 matmuls with a rank-sized dimension (bf16: the grouped LoRA
  products): their bytes over their time, as a share of HBM's; attention: the attention kernels' score-tile
  FLOPs over their time;
- serial_add: accumulating index_puts' time beyond bytes and floors, over their duplicates;
- host (profiled: the profiler's overhead included): an operation that launches nothing and an autograd
  node cost their medians on the trace; a Python function call, a torch call from Python, an operation
  that launches and a further launch: non-negative least squares over the host's time between consecutive
  operations' starts (less the views' and nodes'); then the scale (unprofiled over profiled host time)
  fitted so that the per-segment LoRA's measured tokens/s over the grouped way's (calibration.json
  "measured", the one host-bound step measured that day) is reproduced.

Only the profile's own figures change calibration.json's "card", "host" and "profile" sections; its
"measured" section (step times of unprofiled runs) is written by hand from the reports. The host is the lease
machine's (`--machine`, e.g. h200-2026-12-04): a different machine's earlier host moves to "hosts" under its name,
where a measured section's "host" still finds it."""

from __future__ import annotations

import argparse
import bisect
import collections
import difflib
import gzip
import json
import math
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]

# profile names folded onto the recorder's (torch 2.11 on the GPU, 2.13 here)
ALIASES = {"_index_put_impl_": "index_put", "index_put_": "index_put", "add_": "add",
           "_flash_attention_forward": "_varlen_attn", "_flash_attention_backward": "_varlen_attn_backward",
           "memcpy_h2d": "_to_copy", "memcpy_d2h": "_to_copy"}


def trace_operations(path: Path, vocabulary: set[str]) -> list[dict]:
    """Every aten operation instance of the trace that launched GPU work, in launch order: its name (the
    outermost enclosing aten operation the recorder knows), thread, CPU start (us), GPU time (us) and kernels."""
    events = json.load(gzip.open(path) if path.suffix == ".gz" else path.open())["traceEvents"]
    cpu = collections.defaultdict(list)
    launches_by_thread = collections.defaultdict(list)
    work = collections.defaultdict(list)
    for event in events:
        category = event.get("cat")
        if category == "cpu_op":
            cpu[event["tid"]].append(event)
        elif category in ("cuda_runtime", "cuda_driver"):
            launches_by_thread[event["tid"]].append(event)
        elif category in ("kernel", "gpu_memset", "gpu_memcpy"):
            work[event["args"].get("correlation")].append(event)
    found = []
    for thread, launches in launches_by_thread.items():
        ops = sorted(cpu[thread], key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        position = 0
        for launch in sorted(launches, key=lambda e: e["ts"]):
            kernels = work.get(launch["args"].get("correlation"), [])
            while position < len(ops) and ops[position]["ts"] <= launch["ts"]:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < ops[position]["ts"]:
                    stack.pop()
                stack.append(ops[position])
                position += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < launch["ts"]:
                stack.pop()
            if not kernels:
                continue
            chain = [e for e in stack if e["name"].startswith("aten::") or "::" in e["name"]]
            pick = next((e for e in chain if e["name"].split("::")[-1] in vocabulary), chain[-1] if chain else None)
            name = pick["name"].split("::")[-1] if pick else launch["name"]
            found.append({"name": name, "thread": thread, "cpu": pick["ts"] if pick else launch["ts"],
                          "key": (name, pick["ts"] if pick else launch["ts"], thread),
                          "gpu": sum(k["dur"] for k in kernels), "kernels": len(kernels), "launch": launch["ts"],
                          "gpu_start": min(k["ts"] for k in kernels)})
    found.sort(key=lambda item: item["launch"])
    merged: list[dict] = []
    for item in found:   # one operation's several launches
        if merged and merged[-1]["key"] == item["key"]:
            merged[-1]["gpu"] += item["gpu"]
            merged[-1]["kernels"] += item["kernels"]
        else:
            merged.append(item)
    launched_at = {launch["args"].get("correlation"): launch["ts"]
                   for launches in launches_by_thread.values() for launch in launches}
    gpu_times = sorted((k["ts"], k["dur"], launched_at.get(correlation, math.inf))
                       for correlation, kernels in work.items() for k in kernels)
    return merged, gpu_times, host_medians(cpu, launches_by_thread)


def host_medians(cpu: dict[int, list[dict]], launches_by_thread: dict[int, list[dict]]) -> dict[str, float]:
    """Measured directly on the profiled host: the median time of an aten operation that launches nothing
    (a view, metadata), and the median time an autograd node takes beyond its aten operations."""
    views, nodes = [], []
    for thread, ops in cpu.items():
        launch_times = sorted(e["ts"] for e in launches_by_thread.get(thread, []))
        stack: list[dict] = []
        inside: dict[int, float] = collections.defaultdict(float)
        node_events = []
        for event in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= event["ts"]:
                stack.pop()
            top_level = event["name"].startswith("aten::") and not any(e["name"].startswith("aten::") for e in stack)
            if top_level:
                first = bisect.bisect_left(launch_times, event["ts"])
                if first >= len(launch_times) or launch_times[first] > event["ts"] + event["dur"]:
                    views.append(event["dur"])
                node = next((e for e in reversed(stack) if e["name"].startswith("autograd::engine::evaluate")), None)
                if node is not None:
                    inside[id(node)] += event["dur"]
            if event["name"].startswith("autograd::engine::evaluate_function"):
                node_events.append(event)
            stack.append(event)
        nodes.extend(e["dur"] - inside[id(e)] for e in node_events)
    return {"view": statistics.median(views) * 1e-6, "node": statistics.median(nodes) * 1e-6}


def align(profiled: list[dict], recorded: list) -> list[tuple[dict, int]]:
    """(profiled operation, index of the recorded operation) pairs, in order."""
    launching = [index for index, op in enumerate(recorded) if op.kind in ("kernel", "h2d", "d2h") and op.launches]
    a = [ALIASES.get(p["name"], p["name"]) for p in profiled]
    b = [ALIASES.get(recorded[i].name, recorded[i].name) for i in launching]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        pairs.extend((profiled[block.a + k], launching[block.b + k]) for k in range(block.size))
    return pairs


def fit_card(pairs: list[tuple[dict, object]], gpu_times: list[tuple[float, float, float]]) -> dict:
    """The card's profile-measured parameters (module docstring), each from its own class of kernels."""
    from gpu_cost.card import ATTENTION, INDEX_PUT_KERNELS, MATMULS, SKINNY, SLICE_BACKWARDS, h200

    card = h200()
    small = [p["gpu"] / p["kernels"] for p, op in pairs if op.kind == "kernel" and op.bytes < 65536
             and op.name not in MATMULS and p["kernels"] == 1]
    floor = statistics.median(small) * 1e-6
    # the GPU's own gap between back-to-back kernels: only where the next kernel was launched before the one
    # before it ended (queued); elsewhere the gap is the host's lateness, which the timeline plays itself
    gaps = [start - (prev_start + prev_dur)
            for (prev_start, prev_dur, _), (start, _, launched) in zip(gpu_times, gpu_times[1:], strict=False)
            if launched <= prev_start + prev_dur]
    gap = statistics.median([g for g in gaps if g >= 0]) * 1e-6
    sums: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for p, op in pairs:
        seconds = p["gpu"] * 1e-6 - p["kernels"] * floor
        if op.kind != "kernel":
            continue
        if op.name in MATMULS and op.gemm is not None and min(op.gemm[1:]) <= SKINNY:
            key, amount = ("bf16_skinny" if op.dtype in ("bfloat16", "float16") else "fp32_skinny"), op.bytes
        elif op.name in MATMULS or op.name in SLICE_BACKWARDS or op.name in ("logsumexp",):
            continue
        elif op.name in ATTENTION:
            key, amount = "attention", op.detail.get("tile_flops", op.flops)
        elif op.detail.get("accumulate"):
            key, amount = "serial_add", max(op.detail.get("max_duplicates", 1) - 1, 0)
            seconds = p["gpu"] * 1e-6 - INDEX_PUT_KERNELS * floor - op.bytes / (card.hbm * 0.9)
        else:
            key, amount = op.detail.get("layout", "generic"), op.bytes
        sums[key][0] += amount
        sums[key][1] += seconds
        sums[key][2] += 1
    out = {"kernel_floor": floor, "launch_gap": gap}
    # a class the profile holds no kernel of (or none with time beyond its floors) keeps the calibration's value
    for key in ("vectorised", "generic", "transposed", "fp32_skinny", "bf16_skinny"):
        amount, seconds, _ = sums[key]
        if amount > 0 and seconds > 0:
            out[key] = amount / seconds / card.hbm
    if sums["attention"][1] > 0:
        out["attention"] = sums["attention"][0] / sums["attention"][1]
    if sums["serial_add"][0] > 0:
        out["serial_add"] = sums["serial_add"][1] / sums["serial_add"][0]
    out["_instances"] = {key: value[2] for key, value in sums.items()}
    return out


def _nonnegative_least_squares(rows: list[list[float]], times: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0 (a column whose coefficient comes out negative is dropped
    and the rest solved again)."""
    import numpy as np

    x, y = np.array(rows, float), np.array(times, float)
    active = list(range(x.shape[1]))
    while True:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all() or not active:
            break
        active = [column for column, value in zip(active, solution, strict=True) if value >= 0]
    out = [0.0] * x.shape[1]
    for column, value in zip(active, solution, strict=True):
        out[column] = float(value)
    return out


def host_features(ops: list) -> list[float]:
    """What the host pays for over these operations: Python functions called, torch calls from Python,
    operations that launch nothing
    (views, metadata), operations that launch kernels, launches beyond each operation's first, autograd
    nodes started."""
    from gpu_cost.card import kernel_launches

    launches = [kernel_launches(op) for op in ops]
    return [float(sum(op.python for op in ops)), float(sum(op.calls for op in ops)),
            float(sum(1 for n in launches if n == 0)),
            float(sum(1 for n in launches if n > 0)), float(sum(n - 1 for n in launches if n > 1)),
            float(sum(1 for op in ops if op.new_node))]


def fit_host(pairs: list[tuple[dict, int]], recorded: list, medians: dict[str, float]) -> dict:
    """Host costs (profiled: the profiler's own overhead included). An operation launching nothing and an
    autograd node cost their medians measured on the trace (`host_medians`); the cost of a Python function
    call, of a torch call from Python, of an operation that launches and of each further launch come from
    non-negative least squares
    over the intervals between consecutive operations' CPU starts on one thread that hold no
    synchronisation, less what the views and nodes in them cost."""
    rows, times = [], []
    for (first, i), (second, j) in zip(pairs, pairs[1:], strict=False):
        elapsed = second["cpu"] - first["cpu"]
        if first["thread"] != second["thread"] or any(op.sync for op in recorded[i:j]) or not 0 < elapsed < 3000:
            continue
        _, _, views, kernels, launches, nodes = host_features(recorded[i:j])
        python = float(sum(op.python for op in recorded[i + 1:j + 1]))   # the Python up to the next one
        calls = float(sum(op.calls for op in recorded[i + 1:j + 1]))
        rows.append([python, calls, kernels, launches])
        times.append(elapsed * 1e-6 - views * medians["view"] - nodes * medians["node"])
    python, call, kernel, launch = _nonnegative_least_squares(rows, times)
    return {"python": python, "call": call, "view": medians["view"], "kernel": kernel, "launch": launch,
            "node": medians["node"], "_intervals": len(times)}


def fit_host_scale(grouped: object, segments: object, calibration: dict, ratio: float) -> float:
    """The host scale (unprofiled / profiled host time) at which the per-segment LoRA's tokens/s over the
    grouped way's, both predicted, is the measured `ratio` (the per-segment step is bound by the host)."""
    from dataclasses import replace

    from gpu_cost.calibration import card_for, host_for
    from gpu_cost.timeline import simulate
    from gpu_cost.workload import THROUGHPUT

    card, host = card_for("h200", calibration), host_for(calibration)

    def predicted(scale: float) -> float:
        rates = []
        for recorded in (segments, grouped):
            timings = simulate(recorded.steps, card, replace(host, scale=scale))
            steps = [i for i in THROUGHPUT if i < len(timings)]
            rates.append(sum(recorded.tokens[i] for i in steps) / sum(timings[i].seconds for i in steps))
        return rates[0] / rates[1]

    return _solve(predicted, ratio, 0.05, 2.0)


def _solve(predicted, target: float, low: float, high: float) -> float:
    """The scale in [low, high] at which the monotonic `predicted(scale)` is `target` (bisection)."""
    rising = predicted(high) > predicted(low)
    for _ in range(40):
        middle = (low + high) / 2
        below = predicted(middle) < target
        low, high = (middle, high) if below == rising else (low, middle)
    return (low + high) / 2


def fit_host_scale_to_step(recorded: object, calibration: dict, timed: range, step_s: float) -> float:
    """The host scale (unprofiled / profiled host time) at which the median of the `timed` steps, run back to
    back as bench/lora_mfu.py's aspen side runs them, is the measured unprofiled `step_s`."""
    import statistics as stats
    from dataclasses import replace

    from gpu_cost.calibration import card_for, host_for
    from gpu_cost.timeline import simulate

    card, host = card_for("h200", calibration), host_for(calibration)

    def predicted(scale: float) -> float:
        timings = simulate(recorded.steps, card, replace(host, scale=scale))
        return stats.median(timings[i].seconds for i in timed if i < len(timings))

    return _solve(predicted, step_s, 0.05, 3.0)


def measured_categories(pairs: list[tuple[dict, object]]) -> dict[str, float]:
    from gpu_cost.timeline import category

    totals: dict[str, float] = collections.defaultdict(float)
    for p, op in pairs:
        totals[category(op)] += p["gpu"] * 1e-3
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


REGRESSION, MEDIAN = "profile (regression, profiler on)", "profile (median on the trace, profiler on)"
HOST_SOURCES = {"python": REGRESSION, "call": REGRESSION, "kernel": REGRESSION, "launch": REGRESSION,
                "view": MEDIAN, "node": MEDIAN, "sync": "assumed", "queue": "CUDA's launch queue (1024 entries)"}


def keep_earlier_host(calibration: dict, machine: str) -> dict:
    """The host section a refit on `machine` starts from: the current one where it is that machine's (a class the
    profile lacks keeps its value); else empty, the current one kept in "hosts" under its own machine's name."""
    current = calibration.get("host", {})
    earlier = current.get("_machine")
    if earlier == machine:
        return dict(current)
    if current:
        if earlier is None:
            raise SystemExit("calibration.json's host has no '_machine': name the machine it was fitted on there "
                             "before a refit on another machine moves it to 'hosts'")
        calibration.setdefault("hosts", {})[earlier] = current
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument("--steps", default="6,7", help="the profiled steps, counted from 0")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--in-order", action="store_true",
                        help="the trace is bench/lora_mfu.py's aspen side's (--profile: every job's k-th batch at step "
                             "k; the 2 steps after --warmup and the timed ones), not profile_step.py's; the host "
                             "scale is then fitted to the measured median of the timed steps (--measured)")
    parser.add_argument("--warmup", type=int, default=2, help="with --in-order: the steps before the timed ones")
    parser.add_argument("--measured", default="measured",
                        help="with --in-order: calibration.json's section of the lease's unprofiled figures (step_s)")
    parser.add_argument("--machine", required=True,
                        help="the lease machine the trace was made on, e.g. h200-2026-12-04: its host costs are kept "
                             "under that name")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "calibration.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.checkout.resolve()))
    sys.path.append(str(BENCH))
    from gpu_cost.workload import Session, benchmark_module, check_checkout, preimport, record_jobs

    check_checkout(args.checkout)
    preimport()   # what must be imported before the virtual device stands in for CUDA (as predict.py does)
    steps = [int(step) for step in args.steps.split(",")]
    bench = benchmark_module(args.checkout)
    with Session("NVIDIA H200") as session:
        recorded = record_jobs(session, bench, args.shape, bench.JOBS, steps=max(steps) + 1, in_order=args.in_order)
    ops = [op for step in steps for op in recorded.steps[step]]
    vocabulary = {op.name for op in ops} | set(ALIASES)
    profiled, gpu_times, medians = trace_operations(args.trace, vocabulary)
    pairs = align(profiled, ops)
    matched_gpu = sum(p["gpu"] for p, _ in pairs)
    total_gpu = sum(duration for _, duration, _ in gpu_times)
    pairs_ops = [(p, ops[i]) for p, i in pairs]
    card = fit_card(pairs_ops, gpu_times)
    host = fit_host(pairs, ops, medians)
    calibration = json.loads(args.out.read_text()) if args.out.exists() else {}
    calibration["card"] = {**calibration.get("card", {}), **card}   # a class the profile lacks keeps its value
    start = keep_earlier_host(calibration, args.machine)
    calibration["host"] = {**start, **host, "_machine": args.machine,
                           "_sources": {**start.get("_sources", {}), **HOST_SOURCES}}
    calibration["host"].pop("_seconds", None)
    if args.in_order:
        lease = calibration[args.measured]
        calibration["host"]["scale"] = fit_host_scale_to_step(recorded, calibration, range(args.warmup, min(steps)),
                                                              lease["step_s"])
        calibration["host"].setdefault("_sources", {})["scale"] = (
            f"fitted: the median of the timed steps of {lease['commit']} ({args.measured}.step_s, "
            f"{lease['step_s']} s, unprofiled)")
    elif "segments_over_grouped" in calibration.get("measured", {}):
        from gpu_cost.workload import apply_settings

        apply_settings(["actors.engine.lora_grouped:GROUPING=segments"])
        with Session("NVIDIA H200") as session:
            segments = record_jobs(session, bench, args.shape, bench.JOBS, steps=max(steps) + 1)
        calibration["host"]["scale"] = fit_host_scale(recorded, segments, calibration,
                                                      calibration["measured"]["segments_over_grouped"])
    calibration["profile"] = {
        "trace": args.trace.name, "checkout_steps": steps, "operations_matched": len(pairs),
        "operations_recorded": sum(1 for op in ops if op.kind in ("kernel", "h2d", "d2h") and op.launches),
        "operations_profiled": len(profiled), "gpu_ms_matched": matched_gpu / 1e3, "gpu_ms_total": total_gpu / 1e3,
        "categories_ms": measured_categories(pairs_ops),
    }
    args.out.write_text(json.dumps(calibration, indent=2) + "\n")
    print(json.dumps({"card": card, "host": host, "profile": calibration["profile"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
