"""One checkout's predictions, in its own process (`gpu_cost_model.py --worker`): record the workload's steps
on the virtual device, play them on the card's timeline, and summarise as JSON: per step its time, GPU time,
launches and synchronisations; the benchmark's figures (the median step of profile_step.py's timed steps,
bench/lora_mfu.py's tokens/s and LoRA-MFU); the GPU time by category over the profiled steps; the operations
that had no rule of their own (bytes-based) and the values the recorder could not know."""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gpu_cost.calibration import card_for, default_machine, host_for
from gpu_cost.card import ATTENTION, MATMULS, SLICE_BACKWARDS, Card, kernel_launches, kernel_time
from gpu_cost.operations import FILLS, GATHERS, REDUCTIONS, SCATTERS, Op
from gpu_cost.timeline import Host, StepTiming, simulate
from gpu_cost.workload import (
    FUSION_WARMUP,
    PROFILED,
    THROUGHPUT,
    TIMED,
    WARMUP,
    Recorded,
    Session,
    benchmark_module,
)

DATASHEET_PEAK_BF16 = 989.4e12   # the LoRA-MFU denominator bench/lora_mfu.py uses for H100 / H200
KNOWN_POINTWISE = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "silu", "silu_backward",
                   "sigmoid", "tanh", "cos", "sin", "where", "clamp", "clamp_min", "clamp_max", "abs", "remainder",
                   "eq", "ne", "lt", "le", "gt", "ge", "maximum", "minimum", "masked_fill", "_to_copy", "copy_",
                   "clone", "cat", "stack", "arange", "bitwise_and", "bitwise_or", "logical_not", "reciprocal",
                   "gelu", "gelu_backward", "threshold_backward", "lerp", "addcmul", "addcdiv", "sign", "floor",
                   "ceil", "round", "fmod", "exp2", "log1p", "expm1", "erf", "square", "sgn"}


def _has_rule(op: Op) -> bool:
    base = op.name.rstrip("_")
    return (op.name in MATMULS or op.name in ATTENTION or op.name in SCATTERS or op.name in GATHERS
            or op.name in SLICE_BACKWARDS or op.name in REDUCTIONS or op.name in FILLS or base in KNOWN_POINTWISE
            or op.name in KNOWN_POINTWISE or op.name.startswith("_foreach_") or op.name.startswith("_fused_")
            or op.name.startswith("memcpy") or op.name.startswith("triton:"))


def read_later(steps: list[list[Op]]) -> list[list[Op]]:
    """The steps as if each read its values back a step later (a what-if the model ranks before the trainer
    does it: `gpu_cost_model.py --read-later`): every host synchronisation inside them dropped from the
    timeline, its host cost kept, so that the host goes on to the next step while the GPU finishes this one."""
    return [[replace(op, sync=False) if op.sync else op for op in ops] for ops in steps]


def graphed(steps: list[list[Op]], warmup: int) -> tuple[list[list[Op]], dict]:
    """The steps as if each one's work up to its read-back were captured once as a CUDA graph and replayed (a
    what-if: `gpu_cost_model.py --graphed`): the host's cost of every operation from the step's first launching one
    to its last before the read-back dropped (`Host.cost` of an operation marked `graphed`), one replay issued in
    their place, the host-to-device copies of the step's new values kept (they fill the graph's inputs), the GPU's
    work unchanged. And what stands in the way of capturing the step as the code makes it today (`blockers`): host
    reads inside that span (a capture cannot wait), host-to-device copies of tensors made during the step (a
    graph replays a copy from the host address it captured: the buffer must outlive it), and how many of the steps
    launch a sequence of kernels and shapes no earlier step launched (each such step needs a capture of its own).
    The first `warmup` steps run as they are (a graph is captured after them: the first steps check and tune
    kernels) and are not counted. A step recorded with compile: graphs' marks (`--fixed-shapes`: workload.GRAPH_SPAN)
    has exactly the part between them replayed, what that mode captures (the inputs' copy before it, the optimizers'
    updates and the read-back after it stay the host's)."""
    out, reads, copies, seen, novel = list(steps[:warmup]), 0, 0, set(), 0
    for ops in steps[warmup:]:
        launching = [index for index, op in enumerate(ops) if kernel_launches(op)]
        syncs = [index for index, op in enumerate(ops) if op.sync]
        marks = [index for index, op in enumerate(ops) if op.detail.get("graph_span")]
        if not launching:
            out.append(ops)
            continue
        first = launching[0]
        end = syncs[-1] if syncs and syncs[-1] > first else len(ops)   # the read-back stays the host's
        if len(marks) == 2:   # compile: graphs' captured part
            first, end = marks[0] + 1, marks[1]
        span = ops[first:end]
        reads += sum(op.sync for op in span)
        copies += sum(op.kind == "h2d" for op in span)
        signature = tuple((op.name, op.shapes) for op in span if kernel_launches(op))
        novel += signature not in seen
        seen.add(signature)
        replay = Op("graph replay", "host", calls=1)
        marked = [op if op.kind == "h2d" else replace(op, detail={**op.detail, "graphed": True}, sync=False)
                  for op in span]
        out.append(ops[:first] + [replay] + marked + ops[end:])
    blockers = {"host_reads_inside": reads, "host_copies_inside": copies, "steps": len(steps) - warmup,
                "steps_needing_their_own_capture": novel}
    return out, blockers


def _with_step_syncs(steps: list[list[Op]]) -> list[list[Op]]:
    """profile_step.py synchronises after every step it times."""
    return [ops + [Op("benchmark sync", "sync", sync=True)] for ops in steps]


def summarise(recorded: Recorded, card_name: str, calibration: dict, *, timed: range = TIMED,
              throughput: range = THROUGHPUT, profiled: range | None = PROFILED, step_syncs: bool = True,
              machine: str | None = None) -> dict:
    """`step_syncs`: each step timed with a synchronisation after it (profile_step.py), else back to back as
    CUDA events between steps time them (bench/lora_mfu.py since: a step's time is the advance of its end).
    `machine`: whose host costs time the host's side (calibration.host_names), the default host's where None."""
    card, host = card_for(card_name, calibration), host_for(calibration, machine)
    flowing = simulate(recorded.steps, card, host)
    per_step = simulate(_with_step_syncs(recorded.steps), card, host) if step_syncs else flowing
    timed_steps = [per_step[i] for i in timed if i < len(per_step)]
    through = [i for i in throughput if i < len(flowing)]
    seconds = sum(flowing[i].seconds for i in through)
    tokens = sum(recorded.tokens[i] for i in through)
    tokens_per_s = tokens / seconds if seconds else 0.0
    mfu = 4 * recorded.matmul_parameters * tokens_per_s / DATASHEET_PEAK_BF16
    out = {
        "predicted_step_s": statistics.median(t.seconds for t in timed_steps),
        "predicted_tokens_per_s": tokens_per_s,
        "predicted_lora_mfu": mfu,
        "tokens": recorded.tokens,
        "steps": [_step(t) for t in per_step],
        "timed_steps": list(timed),
        "throughput_steps": through,
        "matmul_parameters": recorded.matmul_parameters,
        "unknown_values": recorded.unknown_values,
        "host_counts": host_counts([op for i in through for op in recorded.steps[i]]),   # the throughput steps'
        "notes": recorded.notes,
        "unruled_operations": sorted({op.name for ops in recorded.steps for op in ops
                                      if op.kind == "kernel" and op.launches and not _has_rule(op)}),
    }
    ordered = sorted(timed_steps, key=lambda t: t.seconds)
    median = ordered[len(ordered) // 2] if ordered else None
    if median is not None:
        out["median_step"] = _step(median)
        out["median_step"]["host_phases"] = host_phases(recorded.steps[per_step.index(median)], host)
        out["median_step"]["host_counts"] = host_counts(recorded.steps[per_step.index(median)])
    if profiled is not None and all(i < len(per_step) for i in profiled):
        categories: Counter = Counter()
        for i in profiled:
            categories.update(per_step[i].categories)
        out["profiled_steps"] = list(profiled)
        out["profiled_categories_ms"] = {name: value * 1e3 for name, value in categories.items()}
        # the profiled run's host: the profiled costs as measured (scale 1), a check of the timeline itself
        profiled_host = simulate(_with_step_syncs(recorded.steps), card, replace(host, scale=1.0))
        out["profiled_step_s"] = [profiled_host[i].seconds for i in profiled]
        out["profiled_gpu_s"] = [per_step[i].gpu_seconds for i in profiled]
    return out


def host_counts(ops: list[Op]) -> dict:
    """How many of each thing the host model prices one step holds (timeline.Host: its fields): Python functions,
    torch calls, operations launching nothing, operations launching kernels, launches beyond each one's first,
    autograd nodes, synchronisations. A host-bound step's time is these counts times the host's costs, so the
    counts of steps measured on one machine are what refits its costs."""
    counts: dict = {"python": 0, "call": 0, "view": 0, "kernel": 0, "launch": 0, "node": 0, "sync": 0}
    launching: Counter = Counter()
    for op in ops:
        launches = kernel_launches(op)
        if launches:
            launching["triton" if op.name.startswith("triton:") else op.name] += 1
        counts["python"] += op.python
        counts["call"] += op.calls
        counts["kernel" if launches else "view"] += 1
        counts["launch"] += max(launches - 1, 0)
        counts["node"] += int(op.new_node)
        counts["sync"] += int(op.sync)
    counts["kernel_operations"] = dict(launching.most_common(25))   # the launching operations, the most frequent
    return counts


def operation_seconds(steps: list[list[Op]], card: Card) -> dict[str, float]:
    """The GPU's seconds a step by operation (an ATen operation's name, a Triton kernel's `triton:` name), the mean
    over `steps`, longest first: what `--fusion` compares between its fewest and most adapters (`report.growth`),
    as the lease's fusion8b part compares its two profiles kernel by kernel."""
    totals: Counter = Counter()
    for ops in steps:
        for op in ops:
            if op.kind == "kernel" and kernel_launches(op):
                totals[op.name] += kernel_time(op, card)
    return {name: value / max(len(steps), 1) for name, value in totals.most_common()}


def host_phases(ops: list[Op], host: Host) -> dict[str, float]:
    """The host's seconds in one step before its backward (packing, forward, loss), in the backward (autograd's
    nodes) and after it (optimizer steps, read-backs)."""
    backward = [index for index, op in enumerate(ops) if op.node is not None]
    first, last = (backward[0], backward[-1]) if backward else (len(ops), len(ops))
    phases = {"before backward": 0.0, "backward": 0.0, "after backward": 0.0}
    for index, op in enumerate(ops):
        phase = "before backward" if index < first else ("backward" if index <= last else "after backward")
        phases[phase] += host.cost(op, kernel_launches(op))
    return phases


def _step(timing: StepTiming) -> dict:
    data = asdict(timing)
    data["gpu_busy"] = timing.gpu_busy
    data["categories"] = {name: value for name, value in sorted(timing.categories.items(), key=lambda kv: -kv[1])}
    return data


def run_worker(args: dict) -> dict:
    """`args`: checkout, shape, jobs, card, mode (jobs | fusion | base | peer), adapters, peer, steps, settings,
    calibration, read_later and graphed (what-ifs of aspen's steps, jobs and fusion: `read_later`, `graphed`; not
    the PEFT sides')."""
    from gpu_cost.workload import (
        apply_settings,
        check_checkout,
        preimport,
        record_base,
        record_fusion,
        record_jobs,
    )

    started = time.perf_counter()
    checkout = Path(args["checkout"])
    check_checkout(checkout)
    preimport()
    if args.get("kernels"):
        import gpu_cost.workload as workload

        workload.KERNELS = args["kernels"]
    if args.get("fixed_shapes") and args["mode"] in ("jobs", "fusion"):
        import gpu_cost.workload as workload

        workload.FIXED_SHAPES = True
    calibration = json.loads(Path(args["calibration"]).read_text())
    bench = benchmark_module(checkout)
    # the LoRA products the engine tunes: on a GPU it times grouped_mm against its Triton kernels during the first
    # steps and takes the faster (actors/engine/kernel_tuning.py); the model has no clock to do so: grouped_mm,
    # unless `--set actors.engine.rank_products:WAY=split_k` (or weight_grad_products:WAY=jagged) asks for another
    pinned = [applied for module in ("rank_products", "weight_grad_products")
              if (checkout / "actors" / "engine" / f"{module}.py").is_file()
              for applied in apply_settings([f"actors.engine.{module}:WAY=grouped_mm"])]
    applied = apply_settings(args.get("settings", []))
    later = bool(args.get("read_later")) and args["mode"] in ("jobs", "fusion")   # aspen's steps only
    if later:
        applied.append("the read-back a step later (what-if: the steps' host synchronisations dropped)")
    if args.get("fixed_shapes") and args["mode"] in ("jobs", "fusion"):
        applied.append("compile: graphs' fixed shapes, each step run eagerly (no capture on the virtual device)")
    as_graphs = bool(args.get("graphed")) and args["mode"] in ("jobs", "fusion")
    if as_graphs:
        applied.append("each step up to its read-back replayed as a CUDA graph (what-if: the host's cost of its "
                       "operations dropped)")
    blockers: list[dict] = []

    def what_if(steps: list[list[Op]], warmup: int) -> list[list[Op]]:
        steps = read_later(steps) if later else steps
        if as_graphs:
            steps, found = graphed(steps, warmup)
            blockers.append(found)
        return steps
    card = card_for(args["card"], calibration)
    machine = args.get("host")
    host_for(calibration, machine)   # an unknown machine fails before the recording, not after
    timed_as = functools.partial(summarise, machine=machine)
    if args.get("kernels"):
        applied.append(f"kernels = {args['kernels']!r}")
    result: dict = {"checkout": str(checkout), "settings": applied, "card": card.name, "pinned": pinned,
                    "host": machine or default_machine(calibration)}
    with Session(card.name) as session:
        if args["mode"] == "jobs" and args.get("profile_step"):   # the 2026-11-28 measurement's set-up
            recorded = record_jobs(session, bench, args["shape"], args["jobs"])
            result.update(timed_as(recorded, args["card"], calibration))
        elif args["mode"] == "jobs":   # bench/lora_mfu.py's aspen side: warm-up, then timed steps in order
            steps = WARMUP + args["steps"]
            recorded = record_jobs(session, bench, args["shape"], args["jobs"], steps=steps, in_order=True)
            recorded.steps = what_if(recorded.steps, WARMUP)
            timed = range(WARMUP, steps)
            result.update(timed_as(recorded, args["card"], calibration, timed=timed, throughput=timed,
                                    profiled=None, step_syncs=False))
        elif args["mode"] == "peer":   # one of bench/lora_mfu.py's single-job PEFT sides
            from gpu_cost.peers import record_peer

            recorded, timed, side = record_peer(session, bench, checkout, args["shape"], args["peer"], args["steps"])
            result.update(timed_as(recorded, args["card"], calibration, timed=timed, throughput=timed,
                                    profiled=None, step_syncs=False))
            result["side"] = side
        elif args["mode"] == "base":
            recorded = record_base(session, bench, args["shape"])
            result.update(timed_as(recorded, args["card"], calibration, profiled=None))
        else:
            fusion = record_fusion(session, bench, args["shape"], args["adapters"])
            result.update(_fusion_summary(fusion, what_if, functools.partial(timed_as, card_name=args["card"],
                                                                             calibration=calibration), card))
    if blockers:
        result["graph_blockers"] = blockers if len(blockers) > 1 else blockers[0]
    result["cpu_seconds"] = time.perf_counter() - started
    return result


def _fusion_summary(fusion: dict, what_if: Callable, timed_as: Callable, card: Any) -> dict:
    """Each adapter count's predicted step and tokens/s with its time by operation, and the fusion efficiency (each
    count's tokens/s over the fewest adapters')."""
    result: dict = {}
    rates = {}
    for count, recorded in fusion.items():
        recorded.steps = what_if(recorded.steps, FUSION_WARMUP)
        timed = range(FUSION_WARMUP, len(recorded.steps))
        summary = timed_as(recorded, timed=timed, throughput=timed, profiled=None, step_syncs=False)
        rates[count] = summary["predicted_tokens_per_s"]
        result[f"adapters_{count}"] = {key: summary[key] for key in
                                       ("predicted_step_s", "predicted_tokens_per_s", "median_step")}
        result[f"adapters_{count}"]["operation_seconds"] = operation_seconds(
            [recorded.steps[index] for index in timed], card)
    first = rates[min(rates)]
    result["fusion_tokens_per_s"] = rates
    result["fusion_efficiency"] = {count: rate / first for count, rate in rates.items()}
    return result
