#!/usr/bin/env python
"""Benchmark of the fused multi-LoRA engine, every ratio measured side by side in one run.

(a) fusion efficiency: tokens/s of a fused training step (forward + backward + optimizer step, through
    `FusedTrainer.run_step`) with 1, 2, 4 and 8 adapters at equal total tokens per step (8 sequences of
    equal length split evenly over the N jobs), as a ratio to 1 adapter. The configurations are run
    round-robin (rotating which goes first) and each one's median step time is taken.
(b) padding share of the tokens processed on real data (GSM8K + Code Alpaca, micro-batches of 8 per job,
    both jobs in every step) for the layouts `packed`, `padded` and `padded_fused`: counting only.
(c) effective tokens/s (real, non-padding tokens) of 4 jobs trained by aspen (`aspen run --in-process`'s
    path: the service's scheduler core and trainer loop, every job fused and packed) vs the same 4 jobs
    trained one after another by a plain PEFT loop (padded batches, attention mask, the model's own loss),
    on the same examples, steps, dtype and threads, each side in a fresh process of its own, rounds
    alternating which goes first (bench/versus_peft.py, which also runs alone).

(d) operation count (`--proxy` runs only this part): the operations (aten operators that do work, views
    left out: actors/engine/operations.py) one fused step dispatches (forward, backward, loss and the
    optimizer steps, through `FusedTrainer.run_step`, after a first step that allocated the optimizers'
    state) with 1, 2, 4, 8, 16 and 32 adapters at equal total tokens per step, grouped LoRA and per-segment
    LoRA side by side, as a ratio to 1 adapter; the optimizer steps' share counted apart. Where a step is
    bound by kernel launches (a small model on a GPU) each operation is about one launch, so this is the
    machine-independent proxy of fusion efficiency (goal: <= 1.05 at 8 and 32 adapters, grouped).

Usage: .venv/bin/python bench/fusion.py [--quick] [--base-model smollm2-135m] [--device auto] [--json PATH]
       .venv/bin/python bench/fusion.py --proxy [--base-model tiny-llama]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from actors.data import TextFormat
from actors.engine import lora_cuda, lora_grouped
from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel, load_base_model
from actors.engine.operations import count_operations
from actors.engine.trainer import FusedTrainer
from bench.fusion_jobs import LORA, fmt_pct, job_spec, log, sync, synthetic_example
from bench.fusion_operations import bench_operations, tiny_llama
from bench.machine import CpuMonitor, cpu_model
from bench.padding_share import CODE_ALPACA, DATA_DIR, GSM8K, bench_padding, load_real_data

GOAL_FUSION = 0.97
GOAL_OPERATIONS = 1.05
GOAL_PACKED_PADDING = 0.01
NOISY_SHARE = 0.10   # other processes' share of the CPU above which timings are flagged


@dataclass
class Settings:
    quick: bool
    # (a)
    fusion_adapters: tuple[int, ...] = (1, 2, 4, 8)
    fusion_sequences: int = 8
    fusion_seq_len: int = 256      # on CPU: 8 x 256 = 2048 tokens, ~9 s a step on 2 cores (quick: 8 x 128)
    fusion_warmup: int = 1
    fusion_reps: int = 5
    # (b)
    padding_steps: int = 250
    padding_batch: int = 8

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if quick:
            return cls(quick=True, fusion_seq_len=128, fusion_reps=2, padding_steps=100)
        return cls(quick=False)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def machine_line(device: torch.device) -> str:
    if device.type == "cuda":
        return f"GPU {torch.cuda.get_device_name(device)}"
    return f"{cpu_model()}, {torch.get_num_threads()} torch threads"


# --------------------------------------------------------------------------------------------------
# (a) fusion efficiency
# --------------------------------------------------------------------------------------------------

def bench_fusion(base: BaseModel, s: Settings) -> dict:
    device = base.device
    vocab = int(base.model.config.vocab_size)
    rng = random.Random(1234)
    sequences = [synthetic_example(rng, s.fusion_seq_len, vocab) for _ in range(s.fusion_sequences)]
    total_tokens = sum(len(e) for e in sequences)
    setups = {}
    for n in s.fusion_adapters:
        if s.fusion_sequences % n:
            raise ValueError(f"{s.fusion_sequences} sequences do not split evenly over {n} jobs")
        per_job = s.fusion_sequences // n
        trainer = FusedTrainer(base, step_tokens=10**9, layout="packed")
        chosen = []
        for i in range(n):
            spec = job_spec(f"fuse{n}-{i}", TextFormat(), per_job)
            job = TrainingJob.create(spec, base, sequences, [], seed=100 * n + i)
            trainer.add_job(job)
            chosen.append((job, sequences[i * per_job:(i + 1) * per_job]))
        setups[n] = (trainer, chosen)

    def one_step(n: int) -> float:
        trainer, chosen = setups[n]
        sync(device)
        started = time.perf_counter()
        report = trainer.run_step(chosen)
        sync(device)
        elapsed = time.perf_counter() - started
        assert report.tokens == total_tokens and report.padding_tokens == 0
        return elapsed

    order = list(s.fusion_adapters)
    log(f"(a) fusion: {s.fusion_sequences} x {s.fusion_seq_len} tokens per step = {total_tokens} tokens, "
        f"adapters {order}, {s.fusion_warmup} warm-up + {s.fusion_reps} timed steps each, round-robin")
    for _ in range(s.fusion_warmup):
        for n in order:
            one_step(n)
    times: dict[int, list[float]] = {n: [] for n in order}
    for rep in range(s.fusion_reps):
        rotated = order[rep % len(order):] + order[:rep % len(order)]
        for n in rotated:
            times[n].append(one_step(n))
        log(f"    rep {rep + 1}: " + "  ".join(f"N={n}: {times[n][-1]:.3f}s" for n in order))
    operations = {n: count_operations(lambda n=n: one_step(n)) for n in order}
    log("    operations dispatched per step (non-view; on CUDA each is about one kernel launch): "
        + "  ".join(f"N={n}: {operations[n]}" for n in order))
    for trainer, chosen in setups.values():
        for job, _ in chosen:
            trainer.remove_job(job.name)
    median = {n: statistics.median(times[n]) for n in order}
    tps = {n: total_tokens / median[n] for n in order}
    # Two cross-checks that shrug off noise differently: the ratio of the fastest steps, and the median of the
    # ratios within each round (a slow spell that hits a whole round cancels out).
    best = {n: total_tokens / min(times[n]) for n in order}
    paired = {n: statistics.median(a / b for a, b in zip(times[order[0]], times[n], strict=True)) for n in order}
    result = {"tokens_per_step": total_tokens, "seq_len": s.fusion_seq_len, "sequences": s.fusion_sequences,
              "warmup_steps": s.fusion_warmup, "timed_steps": s.fusion_reps,
              "per_adapters": {str(n): {"median_step_s": median[n], "min_step_s": min(times[n]),
                                        "max_step_s": max(times[n]), "tokens_per_s": tps[n],
                                        "ratio_to_1": tps[n] / tps[order[0]],
                                        "ratio_to_1_fastest_steps": best[n] / best[order[0]],
                                        "ratio_to_1_median_per_round": paired[n], "step_times_s": times[n],
                                        "operations_per_step": operations[n]}
                               for n in order}}
    for n in order:
        log(f"    N={n}: median {median[n]:.3f}s  {tps[n]:.0f} tok/s  ratio {tps[n] / tps[order[0]]:.3f}  "
            f"(fastest steps {best[n] / best[order[0]]:.3f}, per round {paired[n]:.3f})")
    return result


# --------------------------------------------------------------------------------------------------
# (c) aspen vs PEFT, each in its own process
# --------------------------------------------------------------------------------------------------

def aspen_vs_peft(args: argparse.Namespace) -> dict:
    """bench/versus_peft.py with this run's model, dtype, device, threads and data; tiny-llama (a model in
    memory only) is replaced by bench/deep_tiny_model.py's narrow random SmolLM2 written to a folder."""
    import tempfile

    from bench import versus_peft

    with tempfile.TemporaryDirectory(prefix="fusion-c-") as folder:
        model = args.base_model
        if model == "tiny-llama":
            from bench import deep_tiny_model

            model = str(Path(folder) / "model")
            deep_tiny_model.main([model])
        argv = ["--base-model", model, "--dtype", "float32" if args.dtype == "auto" else args.dtype,
                "--device", args.device, "--data-dir", str(args.data_dir), *(["--quick"] if args.quick else []),
                *(["--threads", str(args.threads)] if args.threads else [])]
        return versus_peft.compare(versus_peft.settle(versus_peft.parser().parse_args(argv)))


def summary(results: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    fusion = results.get("fusion")
    if fusion:
        per = fusion["per_adapters"]
        first = next(iter(per))
        size = f"{fusion['sequences']} x {fusion['seq_len']} tokens"
        rows.append((f"(a) fused step, {first} adapter, {size}, tok/s", f"{per[first]['tokens_per_s']:.0f}", "", ""))
        last = list(per)[-1]
        for n, item in per.items():
            if n == first:
                continue
            goal = f">= {GOAL_FUSION}" if n == last else ""
            ok = ("met" if item["ratio_to_1"] >= GOAL_FUSION else "NOT met") if goal else ""
            rows.append((f"(a) fusion efficiency, {n} adapters / 1", f"{item['ratio_to_1']:.3f}", goal, ok))
    operations = results.get("operations")
    if operations:
        for mode, label in (("grouped", "grouped"), ("segments", "per segment")):
            per = operations["per_mode"][mode]
            for n in ("8", "32"):
                if n in per:
                    goal = f"<= {GOAL_OPERATIONS}" if mode == "grouped" else ""
                    ok = ("met" if per[n]["ratio_to_1"] <= GOAL_OPERATIONS else "NOT met") if goal else ""
                    rows.append((f"(d) operations per step, {label}, {n} adapters / 1", f"{per[n]['ratio_to_1']:.3f}",
                                 goal, ok))
    padding = results.get("padding")
    if padding:
        for layout, share in padding["padding_share"].items():
            goal = f"<= {fmt_pct(GOAL_PACKED_PADDING)}" if layout == "packed" else ""
            ok = ("met" if share <= GOAL_PACKED_PADDING else "NOT met") if goal else ""
            rows.append((f"(b) padding / processed tokens, {layout}", fmt_pct(share), goal, ok))
    elif "padding" in results:   # None: no data (absent: skipped on request)
        rows.append(("(b) padding share", "skipped", "", "no ../shared/data"))
    e2e = results.get("aspen_vs_peft")
    if e2e:
        jobs = len(e2e["jobs"])
        rows.append((f"(c) aspen, {jobs} jobs fused+packed, eff. tok/s", f"{e2e['aspen_effective_tokens_per_s']:.0f}",
                     "", ""))
        rows.append((f"(c) PEFT, {jobs} jobs one after another, eff. tok/s",
                     f"{e2e['peft_effective_tokens_per_s']:.0f}", "", ""))
        rows.append(("(c) aspen / PEFT, each in its own process (per round: "
                     + ", ".join(f"{r:.2f}" for r in e2e["ratios"]) + ")", f"{e2e['ratio']:.2f}x",
                     f">= {e2e['goal']}x", "met" if min(e2e["ratios"]) >= e2e["goal"] else "NOT met"))
    return rows


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    header = ("measurement", "value", "goal", "")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    line = "  ".join("-" * w for w in widths)
    print(line)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    print(line)
    for r in rows:
        print("  ".join([r[0].ljust(widths[0]), r[1].rjust(widths[1]), r[2].ljust(widths[2]), r[3]]).rstrip())
    print(line)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps (~4 min on 2 CPU cores)")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="(a): tokens per sequence, 8 sequences per step (default: 256 on CPU, 128 with "
                             "--quick, 512 on CUDA)")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR,
                        help=f"folder with {GSM8K.name} and {CODE_ALPACA.name} (default: ../shared/data)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice, one per core)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d")
    parser.add_argument("--proxy", action="store_true",
                        help="run only (d), the operation count (with --base-model tiny-llama: a small random Llama)")
    parser.add_argument("--adapters", default=None,
                        help="(a): comma-separated numbers of adapters (default 1,2,4,8; each must divide --sequences)")
    parser.add_argument("--sequences", type=int, default=None, help="(a): sequences per step (default 8)")
    parser.add_argument("--lora-grouping", default="auto", choices=["auto", "grouped", "segments"],
                        help="how the engine runs the adapters' updates: grouped (on CUDA's path, torch._grouped_mm "
                             "over the jobs' segments; on the float32 path, padded batched products) or per segment "
                             "(auto: grouped on CUDA, per segment elsewhere)")
    return parser.parse_args(argv)


def load_base(args: argparse.Namespace, skip: set[str]) -> tuple[BaseModel | None, torch.device]:
    """The base the parts run on (none where only (c) runs: its sides load theirs in processes of their own), and
    the device they run on."""
    if {"a", "b", "d"} <= skip:
        base = None
    elif args.base_model == "tiny-llama":
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        base = tiny_llama(torch.device(auto if args.device == "auto" else args.device))
    else:
        base = load_base_model(args.base_model, dtype=args.dtype, device=args.device)
    device = base.device if base is not None else torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    return base, device


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    lora_grouped.GROUPING = args.lora_grouping
    lora_cuda.KERNEL = {"auto": "auto", "grouped": "grouped_mm", "segments": "segments"}[args.lora_grouping]
    skip = {p.strip() for p in args.skip.split(",") if p.strip()}
    s = Settings.make(args.quick)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    run_started = time.perf_counter()
    started = time.perf_counter()
    if args.proxy:
        skip |= {"a", "b", "c"}
    if args.adapters:
        s.fusion_adapters = tuple(int(n) for n in args.adapters.split(","))
    if args.sequences:
        s.fusion_sequences = args.sequences
    base, device = load_base(args, skip)
    if args.seq_len:
        s.fusion_seq_len = args.seq_len
    elif device.type == "cuda":
        s.fusion_seq_len = 512  # 8 x 512 = 4096 tokens, the engine's default step_tokens
    machine = machine_line(device)
    if base is not None:
        log(f"loaded {args.base_model} ({base.dtype}, {device}) in {time.perf_counter() - started:.1f}s; {machine}; "
            f"LoRA updates: {args.lora_grouping}")

    results: dict = {"quick": s.quick, "base_model": args.base_model, "device": str(device), "machine": machine,
                     "torch": torch.__version__, "dtype": str(base.dtype).replace("torch.", "") if base else args.dtype,
                     "lora": LORA.model_dump(), "lora_grouping": args.lora_grouping, "timings_s": {}}

    results["other_processes_cpu_share"] = {}
    whole_run = CpuMonitor()

    def finish_part(key: str, started: float, monitor: CpuMonitor) -> None:
        results["timings_s"][key] = time.perf_counter() - started
        share = monitor.others_share()
        results["other_processes_cpu_share"][key] = share
        if share is not None and share > NOISY_SHARE:
            log(f"    WARNING: other processes used {fmt_pct(share)} of the CPU during this part; "
                "its timings are noisy")

    if "a" not in skip:
        started, monitor = time.perf_counter(), CpuMonitor()
        results["fusion"] = bench_fusion(base, s)
        finish_part("fusion", started, monitor)

    if "d" not in skip:
        started = time.perf_counter()
        results["operations"] = bench_operations(base)
        results["timings_s"]["operations"] = time.perf_counter() - started

    # a base without a tokenizer (tiny-llama) cannot tokenize the real data
    data = None if "b" in skip or base.tokenizer is None else load_real_data(base, args.data_dir)
    if "b" in skip:
        pass
    elif data is None:
        log(f"{args.data_dir} is missing GSM8K / Code Alpaca, or the model has no tokenizer: skipping (b)")
        results["padding"] = None
    else:
        started = time.perf_counter()
        results["padding"] = bench_padding(data[0], data[1], base.pad_token_id, s.padding_steps, s.padding_batch)
        results["timings_s"]["padding"] = time.perf_counter() - started

    if "c" not in skip:
        started, monitor = time.perf_counter(), CpuMonitor()
        results["aspen_vs_peft"] = aspen_vs_peft(args)
        finish_part("aspen_vs_peft", started, monitor)

    results["timings_s"]["total"] = time.perf_counter() - run_started
    results["other_processes_cpu_share"]["run"] = whole_run.others_share()
    print()
    print_table(summary(results))
    print(f"machine: {machine}; torch {torch.__version__}; dtype {results['dtype']}; base model {args.base_model}; "
          f"{'quick' if s.quick else 'full'} run in {results['timings_s']['total']:.0f}s")
    share = results["other_processes_cpu_share"]["run"]
    if share is not None:
        note = " -- timings are NOT reliable, rerun on an idle machine" if share > NOISY_SHARE else ""
        print(f"CPU used by other processes during the measurements: {fmt_pct(share)} of {os.cpu_count()} cores{note}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
