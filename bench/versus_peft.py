#!/usr/bin/env python
"""aspen against PEFT as users run them: the same jobs, examples, steps, dtype and threads, each side in a
fresh process of its own; the ratio aspen / PEFT of effective (non-padding) tokens/s. Goal: >= 1.3.

    .venv/bin/python bench/versus_peft.py [--quick] [--rounds 2] [--steps 10] [--jobs 4] [--batch 4]
                                          [--threads N] [--base-model smollm2-135m] [--json PATH]

aspen: `train_locally` on a jobs spec, what `aspen run --in-process` runs (the service's scheduler core and
the same `TrainerLoop` as `aspen run`'s trainer actor: memory admission, the allocator settings it makes,
step log, metrics, the final checkpoint and adapters), every job fused and packed.
PEFT: a plain PEFT loop per job, one job after another: `get_peft_model`, AdamW, padded batches with an
attention mask, the model's own loss, gradient clipping, `save_pretrained` at the end. The PEFT process
imports torch, transformers and peft only (not aspen: nothing aspen sets at import, such as MKL's
reproducibility mode, reaches it); its batches are the ones aspen's data cursor gives each job (tokenized
here, in the parent, by aspen's own job data), and the parent checks per job and step that both sides
trained the same number of real tokens.

Why separate processes: a process's allocator settings (glibc's mmap threshold), its warm heap, caches and
threads are its own. Run in one process, the PEFT side ran under whatever aspen had set: aspen's trainer
fixed glibc's mmap threshold at 64 KiB for about a day, which cost its steps 25-30% on an Intel Xeon, and a
one-process comparison could not see it (docs/benchmarks.md).

Each side's time is its training window: from the end of each job's first step (the first steps warm the
process up: excluded on both sides) to the end of its last step, with what runs between steps (aspen's
trainer loop, PEFT's collation) and the final save inside; model loading and tokenizing are outside.
Rounds alternate which side goes first; each round prints its own ratio, since on a shared machine the
speed drifts between rounds."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import CpuMonitor, cpu_model
from bench.versus_peft_sides import RESULT

SIDES = Path(__file__).resolve().parent / "versus_peft_sides.py"

DATA_DIR = REPO.parent / "shared" / "data"
GSM8K, CODE_ALPACA = "gsm8k_train.jsonl", "code_alpaca_2k.json"
GSM8K_FORMAT = {"type": "prompt_response", "prompt": "Question: {question}\nAnswer:", "response": " {answer}"}
LORA = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LORAS = [LORA, {**LORA, "r": 16, "alpha": 32.0}]   # the jobs' adapters, alternately: r 8 and r 16 on q/k/v/o
LR = 3e-4
MAX_GRAD_NORM = 1.0
MAX_SEQ_LEN = 512   # the jobs' default
GOAL = 1.3
MEMORY_GOAL = 0.25        # aspen's peak resident set / the four PEFT processes' together
PREDICTION_GOAL = 0.10    # the trainer's predicted resident peak off the kernel's count (VmHWM)


def log(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------------------
# the parent: data, jobs spec, each side's plan
# --------------------------------------------------------------------------------------------------

def write_job_data(folder: Path, data_dir: Path, jobs: int, rows: int) -> list[tuple[str, Path, dict]]:
    """Each job's data file (name, path, format): GSM8K and Code Alpaca rows, alternately, each job its own
    disjoint rows; generated text of similar lengths where `data_dir` lacks them."""
    folder.mkdir(parents=True, exist_ok=True)
    gsm_path, code_path = data_dir / GSM8K, data_dir / CODE_ALPACA
    out = []
    if gsm_path.is_file() and code_path.is_file():
        gsm = [json.loads(line) for line in gsm_path.read_text().splitlines()[:rows * jobs]]
        code = json.loads(code_path.read_text())[:rows * jobs]
        for index in range(jobs):
            source, fmt, kind = (gsm, GSM8K_FORMAT, "gsm8k") if index % 2 == 0 else (code, {"type": "alpaca"},
                                                                                      "code-alpaca")
            name = f"{kind}-{index // 2}"
            path = folder / f"{name}.jsonl"
            path.write_text("".join(json.dumps(row) + "\n" for row in source[index // 2::(jobs + 1) // 2][:rows]))
            out.append((name, path, fmt))
        return out
    rng = random.Random(99)
    words = [f"w{i}" for i in range(2000)]
    for index in range(jobs):
        lo, hi = (60, 200) if index % 2 == 0 else (20, 120)   # ~ GSM8K's and Code Alpaca's token lengths
        name = f"generated-{index}"
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(lo, hi)))}) + "\n"
                                for _ in range(rows)))
        out.append((name, path, {"type": "text"}))
    return out


def run_spec_dict(jobs: list[tuple[str, Path, dict]], args: argparse.Namespace, output_dir: Path) -> dict:
    """The jobs file both sides train: `steps` + 1 optimizer steps per job (the first one warms up), a
    constant learning rate, no evaluations and no checkpoint before the end (the PEFT loop makes none)."""
    return {"base_model": args.base_model, "dtype": args.dtype, "device": args.device,
            "output_dir": str(output_dir), "seed": 0, "step_tokens": args.step_tokens,
            "jobs": [{"name": name, "data": str(path), "format": fmt, "lora": LORAS[index % 2],
                      "batch_size": args.batch, "max_steps": args.steps + 1, "lr": LR, "lr_schedule": "constant",
                      "warmup_steps": 0,
                      "max_grad_norm": MAX_GRAD_NORM, "max_seq_len": MAX_SEQ_LEN, "checkpoint_every": args.steps + 1,
                      "checkpoint_every_s": None}
                     for index, (name, path, fmt) in enumerate(jobs)]}


def peft_plan(spec_dict: dict, args: argparse.Namespace) -> dict:
    """What the PEFT process needs, with no aspen import on its side: the model's files, the dtype and
    device aspen resolves, and each job's batches as aspen's data cursor gives them (token ids, labels)."""
    from actors.engine.models import resolve_device, resolve_dtype
    from actors.service.scheduler.job_data import JobData
    from actors.spec.run_spec import RunSpec
    from actors.storage.sources import load_base_tokenizer, resolve_source

    spec = RunSpec.model_validate(spec_dict)
    source = resolve_source(spec.base_model)
    device = resolve_device(spec.device)
    dtype = str(resolve_dtype(spec.dtype, device)).removeprefix("torch.")
    tokenizer = load_base_tokenizer(spec.base_model)
    pad = next((int(t) for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    jobs = []
    for submission in spec.submissions():
        data = JobData(submission.job.name, submission, tokenizer)
        data.prepare()
        batches = [data.cursor.next_batch() for _ in range(submission.job.max_steps)]
        jobs.append({"name": submission.job.name, "lora": submission.job.lora.model_dump(include=set(LORA)),
                     "batches": [[[list(e.input_ids), list(e.labels)] for e in batch]
                                                              for batch in batches]})
    return {"model_path": source.path, "gguf_file": source.gguf_file, "local_files_only": source.local_files_only,
            "dtype": dtype, "device": str(device), "pad_token_id": pad, "lr": LR,
            "max_grad_norm": MAX_GRAD_NORM, "threads": args.threads, "jobs": jobs}


# --------------------------------------------------------------------------------------------------
# rounds
# --------------------------------------------------------------------------------------------------

def run_side(side: str, plan_path: Path, extra_env: dict[str, str] | None = None) -> tuple[dict, float | None]:
    """One side in a fresh process: its result and the share of the CPU other processes took meanwhile."""
    monitor = CpuMonitor()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {})}
    done = subprocess.run([sys.executable, str(SIDES), side, str(plan_path)], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} side failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise RuntimeError(f"the {side} side printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len(RESULT):]), monitor.others_share()


def same_batches(aspen: dict, peft: dict) -> None:
    """Both sides trained each job's same micro-batches: equal real tokens per job and step."""
    for name, steps in peft["per_job"].items():
        theirs = [tokens for tokens, _ in steps]
        ours = [tokens for tokens, _ in aspen["per_job"].get(name, [])]
        if ours != theirs:
            raise RuntimeError(f"job {name}: aspen trained {ours} real tokens per step, PEFT {theirs}: the sides did "
                               "not train the same batches")


def compare(args: argparse.Namespace) -> dict:
    import torch

    threads = args.threads or torch.get_num_threads()
    args.threads = threads
    aspen_env = dict(item.split("=", 1) for item in args.aspen_env)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="aspen-vs-peft-") as folder:
        folder = Path(folder)
        rows = max(64, 2 * args.batch * (args.steps + 1))
        jobs = write_job_data(folder / "data", args.data_dir, args.jobs, rows)
        data = "real" if jobs[0][2]["type"] != "text" else "generated"
        spec = run_spec_dict(jobs, args, folder / "aspen-out")
        started = time.perf_counter()
        plan = peft_plan(spec, args)
        log(f"(c) aspen vs PEFT, each side in a fresh process: {args.jobs} jobs ({', '.join(n for n, _, _ in jobs)}; "
            f"{data} data) x batch {args.batch}, 1 warm-up + {args.steps} timed steps each, {plan['dtype']} on "
            f"{plan['device']}, {threads} torch threads, {args.rounds} round(s); batches tokenized in "
            f"{time.perf_counter() - started:.1f}s"
            + (f"; the aspen side's environment: {aspen_env}" if aspen_env else ""))
        for index in range(args.rounds):
            order = ("aspen", "peft") if index % 2 == 0 else ("peft", "aspen")
            results, shares = {}, {}
            for side in order:
                if side == "aspen":
                    out = folder / f"aspen-out-{index}"
                    path = folder / f"aspen-{index}.json"
                    path.write_text(json.dumps({"spec": {**spec, "output_dir": str(out)}, "threads": threads}))
                    results[side], shares[side] = run_side(side, path, aspen_env)
                else:   # one process per job, as four PEFT scripts run
                    results[side], shares[side] = peft_processes(plan, folder)
            aspen, peft = results["aspen"], results["peft"]
            same_batches(aspen, peft)
            for side, result in results.items():
                if result["threads"] != threads:
                    raise RuntimeError(f"the {side} side ran {result['threads']} torch threads, not {threads}")
            row = {"order": list(order), "aspen": aspen, "peft": peft, "others_cpu_share": shares,
                   "aspen_tokens_per_s": aspen["tokens"] / aspen["seconds"],
                   "peft_tokens_per_s": peft["tokens"] / peft["seconds"]}
            row["ratio"] = row["aspen_tokens_per_s"] / row["peft_tokens_per_s"]
            row["ratio_inside_steps"] = (aspen["tokens"] / aspen["step_seconds"]) / row["peft_tokens_per_s"]
            row["memory_ratio"] = aspen["peak_resident_bytes"] / sum(peft["peak_resident_bytes_per_process"])
            predicted = aspen["predicted_peak_bytes"]
            row["prediction_error"] = (None if predicted is None else
                                       (predicted - aspen["peak_resident_bytes"]) / aspen["peak_resident_bytes"])
            rounds.append(row)
            log(f"    round {index + 1} ({' first, '.join(order)} second): aspen {row['aspen_tokens_per_s']:.0f} "
                f"effective tok/s ({aspen['tokens']} tokens in {aspen['seconds']:.1f}s, {aspen['timed_steps']} fused "
                f"steps, {aspen['jobs_per_step']:.2f} jobs per step), PEFT {row['peft_tokens_per_s']:.0f} "
                f"({peft['tokens']} tokens in {peft['seconds']:.1f}s; {peft['padded_tokens']} with padding): "
                f"ratio {row['ratio']:.2f} (inside the fused steps {row['ratio_inside_steps']:.2f}); other processes "
                + ", ".join(f"{s} {100 * v:.0f}%" if v is not None else f"{s} ?" for s, v in shares.items())
                + " of the CPU")
            log(f"      peak resident set: aspen {gib(aspen['peak_resident_bytes'])} (reported by its trainer "
                f"{gib(aspen['reported_peak_bytes'])}, predicted before its steps "
                + (f"{gib(predicted)}: {100 * row['prediction_error']:+.1f}%" if predicted is not None else "-")
                + f"), PEFT per process {', '.join(gib(b) for b in peft['peak_resident_bytes_per_process'])}: "
                f"aspen / the {len(peft['peak_resident_bytes_per_process'])} PEFT processes "
                f"{row['memory_ratio']:.3f} (goal <= {MEMORY_GOAL})")
    aspen_tps = sum(r["aspen"]["tokens"] for r in rounds) / sum(r["aspen"]["seconds"] for r in rounds)
    peft_tps = sum(r["peft"]["tokens"] for r in rounds) / sum(r["peft"]["seconds"] for r in rounds)
    first = rounds[0]
    gaps = [abs(first["aspen"]["per_job"][name][0][1] - steps[0][1]) / abs(steps[0][1])
            for name, steps in first["peft"]["per_job"].items()]
    log(f"    first step's loss (both adapters still no-ops), aspen vs PEFT: max relative difference {max(gaps):.1e}; "
        "last step's: " + ", ".join(f"{name} {first['aspen']['per_job'][name][-1][1]:.3f}/{steps[-1][1]:.3f}"
                                    for name, steps in first["peft"]["per_job"].items()))
    ratios = [r["ratio"] for r in rounds]
    memory_ratios = [r["memory_ratio"] for r in rounds]
    errors = [abs(r["prediction_error"]) for r in rounds if r["prediction_error"] is not None]
    result = {"memory_ratios": memory_ratios, "memory_goal": MEMORY_GOAL,
              "prediction_errors": [r["prediction_error"] for r in rounds], "prediction_goal": PREDICTION_GOAL,
              "machine": cpu_model(), "threads": threads, "aspen_env": aspen_env, "jobs": [n for n, _, _ in jobs],
              "data": data,
              "batch_size": args.batch, "timed_steps_per_job": args.steps, "dtype": plan["dtype"],
              "device": plan["device"], "rounds": rounds, "ratios": ratios, "aspen_effective_tokens_per_s": aspen_tps,
              "peft_effective_tokens_per_s": peft_tps, "ratio": aspen_tps / peft_tps,
              "first_step_loss_max_relative_difference": max(gaps), "goal": GOAL}
    log(f"    aspen / PEFT, effective tokens/s: {result['ratio']:.2f} over all rounds ({aspen_tps:.0f} vs "
        f"{peft_tps:.0f}); per round {', '.join(f'{r:.2f}' for r in ratios)}; goal >= {GOAL}: "
        f"{'met' if min(ratios) >= GOAL else 'NOT met'} ({result['machine']})")
    log(f"    aspen / four PEFT processes, peak resident set: {max(memory_ratios):.3f} at most; goal <= {MEMORY_GOAL}: "
        f"{'met' if max(memory_ratios) <= MEMORY_GOAL else 'NOT met'}; the trainer's predicted peak off the "
        "kernel's count by " + (f"{100 * max(errors):.1f}% at most; goal <= {100 * PREDICTION_GOAL:.0f}%: "
                                f"{'met' if max(errors) <= PREDICTION_GOAL else 'NOT met'}" if errors else
                                "- (no prediction: not a CPU, or no /proc)"))
    return result


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def peft_processes(plan: dict, folder: Path) -> tuple[dict, float | None]:
    """The PEFT side as users run four jobs: one process per job, one after another; their times and tokens
    added up, each process's peak resident set kept."""
    merged: dict = {"tokens": 0, "seconds": 0.0, "padded_tokens": 0, "per_job": {},
                    "peak_resident_bytes_per_process": []}
    shares = []
    for index, job in enumerate(plan["jobs"]):
        path = folder / f"peft-{index}.json"
        path.write_text(json.dumps({**plan, "jobs": [job]}))
        result, share = run_side("peft", path)
        for key in ("tokens", "seconds", "padded_tokens"):
            merged[key] += result[key]
        merged["per_job"].update(result["per_job"])
        merged["peak_resident_bytes_per_process"].append(result["peak_resident_bytes"])
        merged["threads"] = result["threads"]
        if share is not None:
            shares.append(share)
    return merged, (statistics.mean(shares) if shares else None)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one round of 3 timed steps, batch 2")
    p.add_argument("--rounds", type=int, default=None, help="rounds, alternating which side goes first (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per job after its first (default 10)")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="sequences per micro-batch (default 4)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's choice)")
    p.add_argument("--base-model", default="smollm2-135m")
    p.add_argument("--step-tokens", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="the aspen side's tokens a fused step (default: auto, as a jobs file leaves it)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help=f"folder with {GSM8K} and {CODE_ALPACA} (default ../shared/data; generated text without)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument("--aspen-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the aspen side only, for A/B runs (e.g. "
                        "MALLOC_MMAP_THRESHOLD_=65536: glibc's mmap threshold fixed at 64 KiB from the start, as "
                        "CPU trainers set it on 2026-11-25/26)")
    return p


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults, smaller with --quick."""
    for name, full, quick in (("rounds", 2, 1), ("steps", 10, 3), ("batch", 4, 2)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    result = compare(settle(args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
