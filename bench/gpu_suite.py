#!/usr/bin/env python
"""The GPU suite: every check and benchmark that needs a CUDA machine, in one command, one report.

Parts, each in its own process group (a part that fails or runs past its time limit is recorded in the
report, its processes killed, and the suite goes on with the next):
  host        bench/host_probe.py: what this machine's host pays to issue each kind of operation the fused step
              issues, unprofiled (the cost model prices a host-bound step by it: gpu_cost_model.py --host-probe)
  tests       pytest tests/gpu (the CUDA paths against their references; the benchmarks' baselines)
  products    bench/lora_products.py: the six LoRA products of each 8B layer group timed each way (grouped_mm, a
              mm a job, one mm over every job's factors, a split-K Triton kernel), 1..32 jobs, beside HBM's copy rate
              and the cost model
  mfu         bench/lora_mfu.py --parts mfu on the Llama-3.1-8B shape: aspen's 4 fused jobs beside (a) the careful
              PEFT loop, (b) PEFT packed with varlen attention and Liger, (c) 4 PEFT processes at once, the frozen
              base and the card's matmul ceiling, each in its own process; with one of aspen's steps profiled
              (bench/profile_step.py: top kernels, launches, syncs, GPU busy) into profile/
  fusion8b    bench/lora_mfu.py --parts fusion: fusion efficiency 1..32 adapters on that shape
  mfu-smollm2 the mfu part's sides on smollm2-135m's shape (random weights)
  memory      bench/memory.py --device cuda: the memory model's step peaks against CUDA's allocator, and
              recomputation (one process)
  pipeline    bench/pipeline_check.py: a 2-stage pipeline trainer against the single-device trainer, in float32
              against a derived bound (two GPUs: NCCL between them; one GPU: both stages on it, CUDA IPC)
  pipeline-memory  bench/pipeline.py --memory-only --device cuda: each stage's memory model on CUDA
  sweep       bench/sweep.py --device cuda: an aspen sweep against Ray Tune + PEFT (a quarter GPU per trial), 8
              trials 4 at once (needs Ray, and ../shared/data's GSM8K rows)
  overhead    bench/overhead.py: the actor system against the in-process engine (needs Ray)
  fusion      bench/fusion.py (a): fusion efficiency at 1..32 adapters on --base-model (32 sequences per step),
              once with grouped LoRA and once per segment
  operations  bench/fusion.py --proxy (d): operations per fused step, grouped vs per segment, 1..32 adapters
  peft        bench/fusion.py (c): 4 jobs fused by aspen against PEFT one after another, each in its own process
  compile     bench/compile_step.py: seconds per fused step, eager against compile
A part may carry its own limit in --parts (`mfu:200,fusion8b:130`); others get --part-timeout. --prediction
FILE (bench/gpu_cost_model.py's JSON) is printed beside lora_mfu's figures.

It writes report.json and report.md (default: runs/gpu-suite/<UTC time>/) naming the device, GPU, torch and
CUDA versions, with each part's exit status, time, key numbers and the tail of its output. Without CUDA it
stops with exit status 2, unless --allow-cpu (a dry run: --allow-cpu --quick --base-model tiny-llama checks
the suite end to end on a CPU; there --quick runs the overhead part with 2 steps per job, and overhead and
memory take minutes each). Exit status 1 when a part failed.

Where one command may only run so long (a leased GPU machine: 10 minutes a command), run the parts one or a
few at a time into one folder: a report already in --out is kept and the parts run again replace theirs.

    make gpu-suite                       # .venv/bin/python bench/gpu_suite.py
    python bench/gpu_suite.py [--quick] [--parts tests,fusion,...] [--out DIR] [--base-model NAME]
                              [--part-timeout SECONDS]
    python bench/gpu_suite.py --parts tests,operations,peft --out runs/gpu-suite/h200 --total-timeout 540
    python bench/gpu_suite.py --parts fusion --out runs/gpu-suite/h200 --total-timeout 540      # and so on
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
PARTS = ("host", "tests", "products", "mfu", "fusion8b", "mfu-smollm2", "memory", "pipeline", "pipeline-memory",
         "sweep", "overhead", "fusion", "operations", "peft", "compile")
# the lease's default: the parts in order of what they tell, each with its limit in seconds, from the H200 lease of
# 2026-11-28 (mfu 63 s for 2 sides; fusion8b 70 s for 8 steps a count; tests 18 s; pipeline 68 s) and the
# estimates in docs/gpu_lease.md
# the checks of correctness first (the 2026-12-04 lease left the pipeline's killed at the deadline), then the 8B
# figures; products (~20 s, and the split-K kernel's compiles) second: what decides how the LoRA products are
# computed, and the cost model's rates for them; smollm2's shape (a goal whose PEFT sides the 2026-12-04 leases did
# not reach) before memory (measured then); the sweep and overhead, never run whole on a GPU, last. A part whose
# limit does not fit the time left lets the later parts that fit run first (main); the host probe (a few seconds)
# before all: the machine's host, which the two 2026-12-04 leases' differed by 1.5-2x and which smollm2's steps are
LEASE_PARTS = ("host:30,tests:60,products:60,pipeline:60,mfu:220,fusion8b:120,mfu-smollm2:100,memory:45,sweep:240,"
               "overhead:150")
ADAPTERS = "1,2,4,8,16,32"
CARDS = ("h100", "h200")   # the cards bench/gpu_cost_model.py prices (--card), as a GPU's name spells them
TAIL = 8000   # characters of each part's output kept in the report (all of it in <part>.log)


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "machine": platform.machine(), "host": platform.node(),
            "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        info["device"] = f"cuda:0 ({torch.cuda.get_device_name(0)})"
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        info["device"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        info["gpu"] = None
    return info


def card_prediction(path: Path | None, gpu: str | None) -> Path | None:
    """The cost model's prediction for the card this runs on: beside `path` (prediction.json, the H200's) the
    `prediction-<card>.json` of the card `gpu` names, where bench/gpu_lease_prepare.sh made one (the H100's);
    else `path` itself (its card is named beside its figures: bench/lora_report.py), or None where it is absent."""
    card = next((name for name in CARDS if gpu and name in gpu.lower()), None)
    named = path.with_name(f"{path.stem}-{card}{path.suffix}") if path is not None and card else None
    return named if named is not None and named.is_file() else (path if path is not None and path.is_file() else None)


def commands(args: argparse.Namespace, out: Path) -> dict[str, list[list[str]]]:
    """Each part's commands (a part may run several)."""
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    seq_len = ["--seq-len", "32" if args.quick else "128"]
    fusion = [py, "bench/fusion.py", *quick, "--base-model", args.base_model]
    cuda = torch.cuda.is_available()
    device = ["--device", "cuda" if cuda else "cpu"]
    chosen = card_prediction(args.prediction, torch.cuda.get_device_name(0) if cuda else None)
    prediction = ["--prediction", str(chosen)] if chosen else []
    lora_mfu = [py, "bench/lora_mfu.py", *quick, *device, *prediction]
    side_timeout = ["--side-timeout", "120" if cuda else "600"]
    return {
        "host": [[py, "bench/host_probe.py", *device, "--json", str(out / "host_probe.json")]],
        "tests": [[py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu",
                   "--ignore=tests/gpu/test_gpu_suite.py", f"--junitxml={out / 'tests.xml'}"]],
        "products": [[py, "bench/lora_products.py", *quick, *device, "--json", str(out / "products.json")]],
        "mfu": [[*lora_mfu, "--parts", "mfu", "--shapes", "llama-3.1-8b", "--profile", str(out / "profile"),
                 *side_timeout, "--json", str(out / "mfu.json")]],
        "fusion8b": [[*lora_mfu, "--parts", "fusion", "--profile", str(out / "profile"),
                      "--json", str(out / "fusion8b.json")]],
        # its steps are the host's: aspen's, (a)'s and (b)'s profiled, different code on one host, so that
        # bench/gpu_cost/profile_fit.py can fit the host's costs on more than aspen's own step
        # with compile: graphs' side second on CUDA (the lever for a host-bound step: gpu_cost_model.py --graphed)
        "mfu-smollm2": [[*lora_mfu, "--parts", "mfu", "--shapes", "smollm2-135m", "--profile", str(out / "profile"),
                         "--profile-peers", "--sides", ("aspen,graphs," if cuda else "aspen,") + "packed,peft,frozen,"
                         "concurrent", *side_timeout, "--json", str(out / "mfu-smollm2.json")]],
        "memory": [[py, "bench/memory.py", *quick, "--device", "cuda", *([] if cuda else ["--allow-cpu"]),
                    "--json", str(out / "memory.json")]],
        "pipeline": [[py, "bench/pipeline_check.py", *([] if cuda else ["--allow-cpu", "--layers", "2",
                                                                          "--hidden", "128"])]],
        "pipeline-memory": [[py, "bench/pipeline.py", "--memory-only", *device]],
        "sweep": [[py, "bench/sweep.py", *device, "--base-model", args.base_model,
                   *(["--steps", "8"] if args.quick else []), "--json", str(out / "sweep.json")]],
        "overhead": [[py, "bench/overhead.py", *quick, "--base-model", args.base_model,
                      *(["--steps", "2"] if args.quick and not cuda else []), "--json", str(out / "overhead.json")]],
        "fusion": [[*fusion, "--skip", "b,c,d", "--adapters", ADAPTERS, "--sequences", "32", *seq_len,
                    "--lora-grouping", mode, "--json", str(out / f"fusion-{mode}.json")]
                   for mode in ("grouped", "segments")],
        "operations": [[*fusion, "--proxy", "--json", str(out / "operations.json")]],
        "peft": [[*fusion, "--skip", "a,b,d", "--json", str(out / "peft.json")]],
        "compile": [[py, "bench/compile_step.py", "--base-model", args.base_model,
                     *(["--warmup", "6", "--steps", "4"] if args.quick else []), "--json", str(out / "compile.json")]],
    }


def parse_parts(text: str, default_limit: float) -> list[tuple[str, float]]:
    """`name[:seconds],...` -> [(name, limit)]."""
    parts = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, limit = entry.partition(":")
        parts.append((name, float(limit) if limit else default_limit))
    return parts


def run_part(name: str, part_commands: list[list[str]], timeout: float, log_dir: Path | None = None) -> dict:
    """Run a part's commands one after another, `timeout` seconds for all of them together."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result: dict = {"part": name, "commands": [" ".join(c) for c in part_commands], "status": "passed",
                    "exit_codes": [], "seconds": 0.0, "timeout_s": timeout, "host": platform.node(),
                    "finished_utc": None, "output_tail": ""}
    started = time.perf_counter()
    outputs = []
    for command in part_commands:
        print(f"[gpu-suite] {name}: {' '.join(command)}", flush=True)
        left = timeout - (time.perf_counter() - started)
        code, output = run_command(command, env, left)
        result["exit_codes"].append(code)
        outputs.append(output)
        if code is None:
            result["status"] = "timed out"
            outputs.append(f"[timed out: the part's limit is {timeout:.0f}s (--part-timeout)]")
            break
        if code != 0:
            result["status"] = "failed"
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["output_tail"] = "\n".join(outputs)[-TAIL:]
    if log_dir is not None:
        (log_dir / f"{name}.log").write_text("\n".join(outputs))
    print(f"[gpu-suite] {name}: {result['status']} in {result['seconds']:.0f}s", flush=True)
    return result


def run_command(command: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """The command's exit status (None: killed at `timeout`) and its output. It runs in a process group of
    its own, killed whole at the limit: the processes a benchmark starts (its cases, Ray's workers, compile
    workers) do not outlive it and keep the device busy for the next part."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        try:   # its output so far; a process that left the group (setsid) may hold the pipes open
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired as still_open:
            process.wait()
            stdout, stderr = still_open.stdout, (_text(still_open.stderr)
                                                 + "\n[its output pipes stayed open 30 s after the kill]")
        return None, _text(stdout) + _text(stderr)
    finally:
        _kill_group(process.pid)   # what it left running after it exited (a no-op where nothing is left)
    # its stdout last, where the report's tail keeps it (a benchmark prints its figures there, its progress and
    # warnings on stderr)
    return process.returncode, ("[stderr]\n" + stderr + "\n[stdout]\n" if stderr.strip() else "") + stdout


def _kill_group(group: int) -> None:
    """Kill the part's process group and every process under its leader that left the group (a new session:
    Ray's daemons, a benchmark's own groups), while the leader still lives to name them."""
    try:
        import psutil
        descendants = psutil.Process(group).children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil, or the leader has exited: the group alone
        descendants = []
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:   # the group has no process left
        pass
    for process in descendants:
        try:
            process.kill()
        except Exception:  # noqa: BLE001 - it ended meanwhile
            pass


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def key_numbers(out: Path) -> dict:
    """The numbers worth a glance, from the parts' JSON files (those that exist)."""
    numbers: dict = {}
    for mode in ("grouped", "segments"):
        fusion = _json(out / f"fusion-{mode}.json")
        if fusion and fusion.get("fusion"):
            per = fusion["fusion"]["per_adapters"]
            numbers[f"fusion_efficiency_{mode}"] = {n: round(v["ratio_to_1"], 3) for n, v in per.items()}
            numbers[f"tokens_per_s_{mode}"] = {n: round(v["tokens_per_s"]) for n, v in per.items()}
    operations = _json(out / "operations.json")
    if operations and operations.get("operations"):
        for mode, per in operations["operations"]["per_mode"].items():
            numbers[f"operations_ratio_{mode}"] = {n: round(v["ratio_to_1"], 3) for n, v in per.items()}
    peft = _json(out / "peft.json")
    if peft and peft.get("aspen_vs_peft"):
        numbers["aspen_over_peft"] = round(peft["aspen_vs_peft"]["ratio"], 3)
    compiled = _json(out / "compile.json")
    if compiled:
        numbers["compile"] = {k: compiled[k] for k in ("median_step_s", "compiled_over_eager", "graphs_in_warmup",
                                                        "graphs_in_timed_steps", "max_adapter_difference")}
    overhead = _json(out / "overhead.json")
    if overhead:
        numbers["overhead"] = {k: v for k, v in overhead.items() if "ratio" in k}
    for name in ("mfu", "mfu-smollm2"):
        for shape, result in ((_json(out / f"{name}.json") or {}).get("shapes") or {}).items():
            sides = result.get("sides", {})
            numbers[shape] = {side: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in figures.items()
                                     if k in ("tokens_per_s", "median_step_s", "lora_mfu", "peak_memory_bytes",
                                              "step_bytes_per_token", "status")}
                              for side, figures in sides.items()}
            numbers[shape]["ratios"] = {k: round(v, 3) for k, v in result.get("ratios", {}).items()}
            if sides.get("graphs", {}).get("graphs"):   # compile: graphs: captures, replays, what stayed eager
                numbers[shape]["graphs"] = sides["graphs"]["graphs"]
            chosen = (sides.get("aspen", {}).get("engine_defaults") or {}).get("tuned_kernels")
            if chosen:   # the kernel each tuned LoRA product's shape took, measured in the first steps
                numbers[shape]["tuned_kernels"] = {key: value["chosen"] for key, value in chosen.items()}
            ceilings = sides.get("frozen", {}).get("matmul_ceilings")
            if ceilings:
                numbers[shape]["matmul_ceiling_tflops"] = {k: round(v / 1e12, 3) for k, v in ceilings.items()}
            for side in ("aspen", "peft", "packed"):   # the PEFT sides' where the part profiled them (smollm2's)
                profile = sides.get(side, {}).get("profile")
                if profile:
                    numbers[shape]["profile" if side == "aspen" else f"{side}_profile"] = {k: profile.get(k) for k in (
                        "gpu_busy_of_unprofiled_step", "kernels_per_step", "launches_per_step", "syncs_per_step")}
    probe = _json(out / "host_probe.json")
    if probe:   # the host's cost of each kind of operation, in microseconds
        numbers["host_probe_us"] = {**{name: round(value["s"] * 1e6, 2) for name, value in probe["kernels"].items()},
                                    "view": round(probe["summary"]["view_median_s"] * 1e6, 2),
                                    "node": round(probe["node"]["s"] * 1e6, 2),
                                    "backward_per_node": round(probe["backward_per_node"]["s"] * 1e6, 2),
                                    "python_call": round(probe["python"]["s"] * 1e6, 3)}
    products = _json(out / "products.json")
    if products:
        summed: dict = {}
        for row in products["rows"]:   # the ways that compute all six products (`stacked`, `split_k` take two)
            if row["way"] == "stacked" or row["way"].startswith("split_k"):
                continue
            key = f"{row['jobs']} jobs, {row['way']}"
            summed[key] = summed.get(key, 0.0) + row["seconds"]
        numbers["lora_products_us_a_layer"] = {key: round(value * 1e6, 1) for key, value in summed.items()}
        numbers["lora_products_failures"] = products["failures"]
    memory = _json(out / "memory.json")
    if memory:
        numbers["memory_model_error"] = {k: memory.get(k) for k in ("median_abs_error", "max_abs_error")}
    sweep = _json(out / "sweep.json")
    if sweep:
        numbers["sweep"] = {k: sweep.get(k) for k in ("trials_per_hour_ratio", "peak_memory_ratio", "gpu_memory_ratio")}
    fusion8b = (_json(out / "fusion8b.json") or {}).get("fusion")
    if not (fusion8b or {}).get("efficiency"):   # the part killed at its limit: what the side wrote so far
        fusion8b = next((_json(p) for p in sorted((out / "sides").glob("*-fusion.json"))), None)
    if fusion8b and fusion8b.get("efficiency"):
        numbers["fusion_efficiency_8b_shape"] = {n: round(v, 3) for n, v in fusion8b["efficiency"].items()}
    if fusion8b and fusion8b.get("profile_growth"):   # where the most adapters' step grew: the top 8 kernels
        grown = fusion8b["profile_growth"]
        numbers["fusion_growth_8b_shape"] = {"adapters": grown["adapters"], **grown["totals"], "grew_most": [
            f"{row['grew_s'] * 1e3:+.2f} ms ({row['seconds_per_step'][0] * 1e3:.2f} -> "
            f"{row['seconds_per_step'][1] * 1e3:.2f}) {row['name'][:70]}" for row in grown["grew_most"][:8]]}
    return numbers


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU suite, {report['started_utc']}", "",
             f"- device: {env.get('device', 'unknown')}",
             f"- GPU: {env.get('gpu') or 'none (CPU dry run)'}"
             + (f", compute capability {env['compute_capability']}" if env.get("compute_capability") else ""),
             f"- torch {env['torch']}, CUDA {env['cuda'] or 'none (a CPU build of torch)'}, Python {env['python']}",
             f"- settings: {'quick' if report['quick'] else 'full'}, base model {report['base_model']}", "",
             "| part | status | seconds | limit (s) |", "|---|---|---|---|"]
    lines += [f"| {p['part']} | {p['status']} | {p['seconds']:.0f} | {p.get('timeout_s', float('nan')):.0f} |"
              for p in report["parts"]]
    lines += ["", "## Key numbers", "", "```", json.dumps(report["key_numbers"], indent=2), "```"]
    for part in report["parts"]:
        lines += ["", f"## {part['part']} ({part['status']})", "", *[f"    {c}" for c in part["commands"]], "",
                  "```", part["output_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _mismatch(earlier: dict, report: dict) -> str | None:
    """Why an earlier report in the same folder is not one this run may add to (other settings, another
    machine or software), or None."""
    for key in ("quick", "base_model"):
        if earlier.get(key) != report[key]:
            return f"{key} {earlier.get(key)!r} there, {report[key]!r} now"
    for key in ("device", "torch", "cuda"):   # the host may differ (a lease's next machine, the same GPU)
        if earlier.get("environment", {}).get(key) != report["environment"][key]:
            return f"{key} {earlier.get('environment', {}).get(key)!r} there, {report['environment'][key]!r} now"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick settings (a smoke run)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without CUDA (a dry run of the suite itself)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}, each optionally NAME:SECONDS (its limit)")
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)   # tests: {part: [command, ...]} instead
    parser.add_argument("--limit-scale", type=float, default=1.0,
                        help="each part's limit times this (a dry run on a slow CPU: the lease's limits are a GPU's)")
    parser.add_argument("--prediction", type=Path,
                        help="bench/gpu_cost_model.py's JSON, shown beside lora_mfu's figures")
    parser.add_argument("--out", type=Path, default=None, help="report folder (default runs/gpu-suite/<UTC time>)")
    parser.add_argument("--base-model", default="smollm2-135m",
                        help="base model of the fusion, operations, PEFT and compile parts (tiny-llama: a small "
                             "random Llama)")
    parser.add_argument("--part-timeout", "--timeout", dest="part_timeout", type=float, default=540,
                        help="seconds each part may run, all its commands together (default 540: a part fits a "
                             "10-minute command with room for the start); past it the part's processes are "
                             "killed and it is recorded as timed out")
    parser.add_argument("--total-timeout", type=float, default=None,
                        help="seconds for this whole invocation (a leased machine's limit per command, less the "
                             "start): each part gets what is left up to --part-timeout; parts with no time left "
                             "are recorded as not run")
    args = parser.parse_args(argv)
    limits = {name: limit * args.limit_scale
              for name, limit in parse_parts(LEASE_PARTS if args.parts == "lease" else args.parts, args.part_timeout)}
    parts = list(limits)
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(f"gpu-suite: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              "run it on a machine with an NVIDIA GPU and a CUDA build of torch, or pass --allow-cpu for a dry "
              "run of the suite on this CPU", file=sys.stderr)
        return 2
    if args.part_timeout <= 0 or (args.total_timeout is not None and args.total_timeout <= 0):
        parser.error("--part-timeout, --total-timeout: a positive number of seconds")
    deadline = None if args.total_timeout is None else time.monotonic() + args.total_timeout
    started = datetime.now(UTC)
    out = args.out or REPO / "runs" / "gpu-suite" / started.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    plan = json.loads(args.plan.read_text()) if args.plan else commands(args, out.resolve())
    report = {"started_utc": started.isoformat(timespec="seconds"), "quick": args.quick,
              "base_model": args.base_model, "environment": environment(), "parts": []}
    earlier = _json(out / "report.json")
    if earlier and earlier.get("parts"):
        problem = _mismatch(earlier, report)
        if problem:
            print(f"gpu-suite: {out} holds a report of another run ({problem}); give another --out or run the "
                  "same settings on the same machine", file=sys.stderr)
            return 2
        report["started_utc"] = earlier["started_utc"]   # this run adds to it: parts run again replace theirs
        report["parts"] = [p for p in earlier["parts"] if p["part"] not in parts]
    queue, deferred = list(parts), set()
    while queue:   # the report is rewritten after every part: an interrupted suite leaves what it did
        name = queue.pop(0)
        left = limits[name] if deadline is None else min(limits[name], deadline - time.monotonic())
        if left < limits[name] and name not in deferred and any(limits[later] <= left for later in queue):
            # its limit does not fit what is left and a later part's does: that one first, this one after with
            # whatever time remains (a sweep cut at 50 s tells nothing; a 90 s part run whole does)
            deferred.add(name)
            queue.append(name)
            print(f"[gpu-suite] {name}: its {limits[name]:.0f} s do not fit the {left:.0f} s left; the parts after it "
                  "that fit run first", flush=True)
            continue
        if left < 1:
            report["parts"].append({"part": name, "commands": [" ".join(c) for c in plan[name]], "status": "not run",
                                    "exit_codes": [], "seconds": 0.0, "timeout_s": 0.0, "host": platform.node(),
                                    "finished_utc": None, "output_tail": "[no time left of --total-timeout]"})
        else:
            report["parts"].append(run_part(name, plan[name], left, out))
        if name in deferred:
            report["parts"][-1]["deferred"] = True
        report["key_numbers"] = key_numbers(out)
        report["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(markdown(report))
    failed = [p["part"] for p in report["parts"] if p["part"] in parts and p["status"] != "passed"]
    earlier_failed = [f"{p['part']} ({p['status']})" for p in report["parts"]
                      if p["part"] not in parts and p["status"] != "passed"]
    print(f"[gpu-suite] report: {out / 'report.md'}; "
          + (f"failed: {', '.join(failed)}" if failed else "every part run now passed")
          + (f"; from earlier runs in the report: {', '.join(earlier_failed)}" if earlier_failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
