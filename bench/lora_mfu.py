#!/usr/bin/env python
"""LoRA-MFU of aspen's fused step beside the setups a user would pick instead, each side in a process of its
own, on the same sequences; and fusion efficiency at 1..32 adapters (issue 47, item 5).

  mfu      per shape (Llama-3.1-8B and smollm2-135m, random weights: the speed does not depend on the values):
           aspen      4 jobs x 2 sequences of 64-768 tokens a step fused by FusedTrainer, per the engine's
                      defaults on the device
           peft       (a) the careful single-job PEFT loop: 8 sequences a step sorted by length and padded to
                      the longest, PEFT's default float32 adapters, fused AdamW, the model's own loss, the 4
                      jobs one after another
           packed     (b) the best single-job setup at hand: PEFT over packed sequences (one row, position ids
                      restarting, a varlen attention kernel), Liger's kernels where liger_kernel imports, bf16
                      and float32 adapters both timed (the faster counts), fused AdamW
           concurrent (c) 4 processes of (a), one job each, at the same time on the one GPU (each its own copy
                      of the base; sequences a step sized to fit the card from (a)'s measured bytes a token)
           frozen     the frozen base over the same packed tokens (forward + input-gradient backward, no
                      LoRA): the ceiling a LoRA trainer approaches; before it, the card's bf16 matmul ceiling
                      (8192^3 and the shape's own GEMM)
           Each timed over >= 20 steps after warm-up by CUDA events between steps (no host sync inside the
           timed steps): median, p10 and p90 step, real (unpadded) tokens/s, peak allocated memory.
           LoRA-MFU = 4 x (matmul parameters) x tokens/s (forward, plus the input gradient; the frozen weights
           get no weight gradient) over the datasheet's dense bf16 peak and over the measured ceiling.
  fusion   tokens/s of a fused step with 1, 2, 4, 8, 16, 32 adapters at equal total tokens (32 sequences of 128
           tokens a step split evenly over the jobs), median of >= 20 timed steps each, as a ratio to 1 adapter.

--prediction FILE (bench/gpu_cost_model.py's JSON) prints each predicted figure beside the measured one;
--profile DIR profiles two of aspen's fused steps after its timed ones (bench/profile_step.py), and two of
fusion's with the fewest and the most adapters after theirs (DIR/<shape>-fusion/adapters-<N>, and where the step's
time grew between them: the result's `profile_growth`); with --profile-peers also two steps of
(a) and of (b) (bf16 adapters) after theirs (DIR/<shape>-peft, DIR/<shape>-packed): on a shape whose steps the
host bounds, different code on one host, what bench/gpu_cost/profile_fit.py needs to fit the host's costs. The goals of
issue 47 are printed beside the figures. Needs torch, transformers and peft (and aspen's engine: pydantic);
liger_kernel is optional.

    python bench/lora_mfu.py [--parts mfu,fusion] [--shapes llama-3.1-8b,smollm2-135m]
                             [--sides aspen,peft,packed,concurrent,frozen] [--steps 20] [--json PATH]
                             [--prediction FILE] [--profile DIR [--profile-peers]] [--side-timeout S]
    python bench/lora_mfu.py --quick --device cpu          # a dry run on a CPU: tiny shapes, a few steps
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lora_bench import (
    FUSION_ADAPTERS,
    GOALS,
    JOBS,
    MAX_LEN,
    MIN_LEN,
    OPTIONAL_SIDES,
    PEFT_SEQUENCES_PER_STEP,
    QUICK_LENGTHS,
    QUICK_SHAPES,
    SHAPES,
    SIDES,
    log,
)

# -- running the sides ------------------------------------------------------------------------------------------

def own_process(side: str, args: argparse.Namespace, shape: str, extra: list[str] | None = None,
                timeout: float | None = None) -> dict:
    """Run one side in a fresh process; its result is the JSON it writes. Its result and its stderr are files in
    `sides/` beside --json (a temporary folder without): a side killed at `timeout`, or this whole command
    killed at its part's limit, leaves what it wrote (fusion writes after each adapter count, aspen before it
    profiles) and its log there."""
    keep = args.json.parent / "sides" if args.json else None
    with tempfile.TemporaryDirectory(prefix=f"lora-mfu-{side}-") as scratch:
        folder = keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        result_file, log_file = folder / f"{shape}-{side}.json", folder / f"{shape}-{side}.log"
        result_file.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--side", side, "--shape", shape, "--device", args.device,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--result", str(result_file),
                   *(["--lengths", ",".join(map(str, QUICK_LENGTHS))] if args.quick else []), *(extra or [])]
        started = time.perf_counter()
        with log_file.open("w") as log_handle:
            # in this process's group: a suite that kills its part's group kills the sides with it
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_handle)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
                kill_tree(process.pid)   # the side and its own processes ((c)'s four)
                process.wait()
        wall = time.perf_counter() - started
        stderr = log_file.read_text(errors="replace")
        sys.stderr.write(stderr[-3000:])
        result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    status = "passed" if code == 0 else ("timed out" if code is None else f"failed (exit {code})")
    if code != 0:
        log(f"[lora_mfu] {shape} {side}: {status} after {wall:.0f}s; last error lines:\n{stderr[-1500:]}")
        result["error"] = stderr[-1500:]
    return {**result, "status": status, "process_wall_s": round(wall, 1)}


def kill_tree(pid: int) -> None:
    """Kill a process and every process under it."""
    import psutil
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def concurrent_sequences(peft: dict | None, quick: bool) -> int:
    """(c)'s sequences a step per process: the most of 8, 4, 2, 1 for which 4 processes' weights and steps
    (MAX_LEN tokens a sequence at (a)'s measured bytes a padded token) fit 90% of the card; 0 where not even one
    does (the 8B shape on an 80 GB H100: 4 copies of its 16 GB base leave ~1.4 GB a process for a ~9 GB step),
    so that the lease does not spend a minute loading four bases to run out of memory."""
    if not peft or not peft.get("step_bytes_per_token") or not peft.get("card_memory_bytes"):
        return 2 if not quick else PEFT_SEQUENCES_PER_STEP
    room = 0.9 * peft["card_memory_bytes"] / JOBS - peft["held_before_steps_bytes"] - 2**30   # 1 GiB: context
    for count in (8, 4, 2, 1):
        if count * MAX_LEN * peft["step_bytes_per_token"] <= room:
            return count
    return 0


def run_shape(shape: str, args: argparse.Namespace) -> dict:
    sides: dict[str, dict] = {}
    stand_in = QUICK_SHAPES.get(shape, shape) if args.quick else shape
    for side in args.sides:
        extra: list[str] = []
        if side == "aspen" and args.profile:
            extra = ["--profile", str(Path(args.profile) / shape)]
        if side == "frozen" and args.profile:
            extra = ["--profile", str(Path(args.profile) / f"{shape}-frozen")]
        if side in ("peft", "packed") and args.profile and args.profile_peers:
            extra = ["--profile", str(Path(args.profile) / f"{shape}-{side}")]
        if side == "concurrent":
            count = concurrent_sequences(sides.get("peft"), args.quick)
            if count == 0:
                peft = sides["peft"]
                sides[side] = {"status": "not run: does not fit", "reason": (
                    f"{JOBS} processes' bases ({peft['held_before_steps_bytes'] / 1e9:.1f} GB each) and one "
                    f"{MAX_LEN}-token sequence's step ({MAX_LEN * peft['step_bytes_per_token'] / 1e9:.1f} GB at (a)'s "
                    f"bytes a token) exceed 90% of the card's {peft['card_memory_bytes'] / 1e9:.1f} GB")}
                log(f"[lora_mfu] {shape}: concurrent {sides[side]['status']}: {sides[side]['reason']}")
                write_partial(args, shape, sides)
                continue
            extra = ["--sequences-per-step", str(count)]
        log(f"[lora_mfu] {shape}{f' (as {stand_in})' if stand_in != shape else ''}: {side}")
        sides[side] = own_process(side, args, stand_in, extra, args.side_timeout)
        write_partial(args, shape, sides)
    return {"shape": shape, "measured_shape": stand_in, "sides": sides, "ratios": ratios(sides)}


def ratios(sides: dict) -> dict:
    rate = {name: side.get("tokens_per_s") for name, side in sides.items()}
    out = {}
    for fused in ("aspen", "graphs"):   # aspen's side, and its compile: graphs side where it ran
        mine = rate.get(fused)
        out.update({f"{fused}_over_{name}": mine / value for name, value in rate.items()
                    if name not in ("aspen", "graphs") and mine and value})
    if rate.get("graphs") and rate.get("aspen"):
        out["graphs_over_aspen"] = rate["graphs"] / rate["aspen"]
    return out


_results: dict = {}


def write_partial(args: argparse.Namespace, shape: str, sides: dict) -> None:
    """The JSON rewritten after every side: a part killed at its limit leaves what it measured."""
    _results.setdefault("shapes", {})[shape] = {"shape": shape, "sides": sides, "ratios": ratios(sides)}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_results, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="mfu,fusion")
    parser.add_argument("--shapes", "--shape", dest="shapes", default="llama-3.1-8b",
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--adapters", default=",".join(map(str, FUSION_ADAPTERS)), help="fusion's adapter counts")
    parser.add_argument("--quick", action="store_true", help="tiny stand-in shapes, 3 timed steps: a dry run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--prediction", type=Path, help="bench/gpu_cost_model.py's JSON: printed beside the figures")
    parser.add_argument("--profile", type=Path,
                        help="profile two of aspen's steps into DIR, two of fusion's at the fewest and most adapters")
    parser.add_argument("--profile-peers", action="store_true",
                        help="with --profile: also two steps of (a) and of (b) (bf16 adapters) after their timed ones")
    parser.add_argument("--side-timeout", type=float, help="seconds each side's process may run")
    # one side in this process (the parent runs each so)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--sequences-per-step", type=int, default=PEFT_SEQUENCES_PER_STEP, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default=f"{MIN_LEN},{MAX_LEN}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if args.side:
        args.shape = args.shapes
        args.min_len, args.max_len = (int(n) for n in args.lengths.split(","))
        if args.device == "cpu":
            torch.set_num_threads(1)   # a dry run beside other processes on few cores
        from lora_sides import run_side
        return run_side(args)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = (sorted(set(args.sides) - set(SIDES) - set(OPTIONAL_SIDES))
               + sorted(set(args.shapes.split(",")) - set(SHAPES)))
    if unknown:
        parser.error(f"unknown side(s) or shape(s): {', '.join(unknown)}")
    parts = set(args.parts.split(","))
    _results.update({"device": args.device, "torch": torch.__version__, "quick": args.quick,
                     "steps": args.steps, "warmup": args.warmup})   # no CUDA in this process: the sides' alone
    prediction = json.loads(args.prediction.read_text()) if args.prediction and args.prediction.is_file() else None
    if args.prediction and prediction is None:
        log(f"[lora_mfu] no prediction at {args.prediction}: the figures are printed without it")
    _results["prediction"] = prediction
    if "mfu" in parts:
        for shape in args.shapes.split(","):
            _results.setdefault("shapes", {})[shape] = run_shape(shape, args)
    if "fusion" in parts:
        shape = QUICK_SHAPES["llama-3.1-8b"] if args.quick else "llama-3.1-8b"
        adapters = [int(n) for n in args.adapters.split(",")]
        if args.quick:
            adapters = [n for n in adapters if n <= 4]
        extra = ["--adapters", ",".join(map(str, adapters))]
        if args.profile:   # the fewest's and the most's steps: where fusion loses (0.73 at 32 on 2026-12-04)
            extra += ["--profile", str(Path(args.profile) / f"{shape}-fusion")]
        _results["fusion"] = own_process("fusion", args, shape, extra, args.side_timeout)
        if args.json:
            args.json.write_text(json.dumps(_results, indent=1))
    from lora_report import report_lines
    _results["goals"] = GOALS
    _results["gpu"] = next((side["device_name"] for r in _results.get("shapes", {}).values()
                            for side in r["sides"].values() if side.get("device_name")),
                           _results.get("fusion", {}).get("device_name"))
    print("\n".join(report_lines(_results)), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_results, indent=1))
    failed = [f"{shape} {name}" for shape, r in _results.get("shapes", {}).items()
              for name, side in r["sides"].items()
              if side.get("status") != "passed" and not side.get("status", "").startswith("not run")]
    if _results.get("fusion", {}).get("status", "passed") != "passed":
        failed.append("fusion")
    if failed:
        log(f"[lora_mfu] sides that did not finish: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
