"""The sides bench/lora_mfu.py runs, one per process (`lora_mfu.py --side NAME --result FILE`): aspen's fused
step, the PEFT baselines (peft_baselines.py), 4 PEFT processes at once, the frozen base with the card's matmul
ceiling, and fusion at 1..32 adapters (bench/fusion_side.py). Each writes its result as JSON to FILE (fusion after
every adapter count, aspen before profiling: what was measured survives a kill)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from fusion_side import fusion_side
from lora_bench import (
    JOBS,
    LORA,
    SHAPES,
    ListSource,
    StepClock,
    allocator_events,
    allocator_events_since,
    compute_dtype,
    engine_settings,
    job_batches,
    log,
    matmul_parameters,
    memory_fields,
    random_model,
    step_summary,
    sync,
    with_mfu,
    write,
)


def the_batches(args: argparse.Namespace, extra: int = 0) -> dict[int, list]:
    vocab = SHAPES[args.shape]["vocab_size"]
    return {job: job_batches(job, args.warmup + args.steps + extra, vocab, args.min_len, args.max_len)
            for job in range(JOBS)}


def timed_sequences(args: argparse.Namespace, batches: dict[int, list]) -> tuple[dict[int, list], list]:
    """Each job's sequences of the timed steps, and every job's warm-up sequences."""
    timed = {job: [s for b in bs[args.warmup:args.warmup + args.steps] for s in b] for job, bs in batches.items()}
    warm = [s for bs in batches.values() for b in bs[:args.warmup] for s in b]
    return timed, warm


# -- aspen ------------------------------------------------------------------------------------------------------

def graphs_side(args: argparse.Namespace, device: torch.device) -> dict:
    """aspen's side with compile: graphs (actors/engine/step_graphs.py): how many steps were replays, in `graphs`."""
    return aspen_side(args, device, compile="graphs")


def aspen_side(args: argparse.Namespace, device: torch.device, compile: str = "none") -> dict:
    """4 jobs fused, every step all four, per the engine's defaults on the device."""
    from actors.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.engine.warmup import settle_garbage_collector, warm_up
    from actors.spec.job_spec import JobSpec
    started = time.perf_counter()
    model = random_model(args.shape, device, compute_dtype(device))
    base = from_module(model, None)
    warm_up(base, 1 << 17)   # as the service's trainer does at start-up (actors/service/trainer/trainer_setup.py)
    trainer = FusedTrainer(base, step_tokens=1 << 17, compile=compile)
    profile_steps = 2 if args.profile else 0
    total = args.warmup + args.steps + profile_steps
    for job, batches in the_batches(args, profile_steps).items():
        examples = [[Example(tuple(ids), tuple(labels)) for ids, labels in batch] for batch in batches]
        spec = JobSpec(name=f"job-{job}", data="unused.jsonl", format={"type": "text"}, batch_size=len(batches[0]),
                       max_steps=total, lr=1e-4, lora=LORA, max_seq_len=args.max_len)
        trainer.add_job(TrainingJob.attach(spec, base, ListSource(examples), [], total, seed=job))
    settle_garbage_collector()   # as aspen's trainer does once set up: full collections skip the start-up's objects
    setup = time.perf_counter() - started
    for _ in range(args.warmup):
        trainer.train_step()
    sync(device)
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    events = allocator_events(device)
    clock, tokens, padded = StepClock(device), [], []
    clock.mark()
    for _ in range(args.steps):
        report = trainer.train_step()
        tokens.append(report.tokens - report.padding_tokens)
        padded.append(report.tokens)
        clock.mark()
    result = with_mfu(step_summary(clock.seconds(), tokens), model, device)
    result.update(allocator_events_since(device, events))
    result.update(memory_fields(device, held, max(padded)), padding_tokens=sum(padded) - sum(tokens),
                  setup_s=round(setup, 1), jobs=JOBS, engine_defaults=engine_settings(trainer))
    if (graphs := trainer.graphs) is not None:   # compile: graphs: replays, what stayed eager, each graph's pool
        entries = graphs.entries.values()
        result["graphs"] = {"captures": graphs.captures, "replays": graphs.replays, "eager_because": sorted(
            graphs.refusals), "shapes": [list(e.shape.capacity) for e in entries], "pool_bytes": [
            e.held for e in entries], "failed": [e.failed for e in entries if e.failed]}
    write(args, result)
    if args.profile:
        from profile_step import profile_steps as profile
        result["profile"] = profile(trainer.train_step, device, profile_steps, args.profile,
                                    median_step_s=result["median_step_s"])
    return result


# -- the PEFT baselines -----------------------------------------------------------------------------------------

def peft_side(args: argparse.Namespace, device: torch.device) -> dict:
    """(a) the careful single-job PEFT loop, the 4 jobs one after another."""
    from peft_baselines import fitting_per_step, run_jobs
    model = random_model(args.shape, device, compute_dtype(device))
    timed, warm = timed_sequences(args, the_batches(args))
    per_step, model = fitting_per_step(model, [s for job in timed.values() for s in job], device,
                                       args.sequences_per_step, packed=False)
    run = run_jobs(model, timed, warm, device, per_step=per_step, packed=False)
    result = with_mfu(step_summary(run["seconds"], run["tokens"]), model, device)
    result.update(memory_fields(device, run["held_bytes"], max(run["padded_tokens"])),
                  padding_tokens=sum(run["padded_tokens"]) - sum(run["tokens"]), adapter_dtype=run["adapter_dtype"],
                  sequences_per_step=per_step, sequences_per_step_asked=args.sequences_per_step)
    if args.profile:
        write(args, result)   # the figures first: a profile cut by the part's limit leaves them
        result["profile"] = profile_peer(args, model, timed, device, packed=False, float32_adapters=True,
                                         median_step_s=result["median_step_s"], per_step=per_step)
    return result


def profile_peer(args: argparse.Namespace, model, timed: dict[int, list], device: torch.device, *, packed: bool,
                 float32_adapters: bool, median_step_s: float, per_step: int | None = None) -> dict:
    """Two steps of a PEFT side (its first job's sequences, a fresh adapter, `per_step` sequences a step: the
    side's, default --sequences-per-step) under the profiler into --profile: the host's work of other code than
    aspen's on the same host, for the cost model's host costs."""
    from peft_baselines import profile_job
    return profile_job(model, timed[min(timed)], device, per_step=per_step or args.sequences_per_step, packed=packed,
                       float32_adapters=float32_adapters, out=args.profile, median_step_s=median_step_s)


def packed_side(args: argparse.Namespace, device: torch.device) -> dict:
    """(b) PEFT over packed rows with the varlen attention and Liger's kernels, bf16 and float32 adapters both
    timed; the faster counts."""
    from peft_baselines import PACKED_ATTENTION, apply_liger, probe_step, run_jobs, varlen_attn
    model = random_model(args.shape, device, compute_dtype(device))
    model.set_attn_implementation(PACKED_ATTENTION)
    liger = apply_liger(model)
    if liger is None:
        try:
            probe_step(model, device)
        except Exception as error:  # noqa: BLE001 - Liger's patch that cannot train: the baseline goes on without it
            liger = f"a step with Liger's kernels failed ({type(error).__name__}: {str(error)[:300]}); measured without"
            log(f"[packed] {liger}")
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = random_model(args.shape, device, compute_dtype(device))
            model.set_attn_implementation(PACKED_ATTENTION)
    timed, warm = timed_sequences(args, the_batches(args))
    variants = {}
    for float32_adapters in (False, True):
        run = run_jobs(model, timed, warm, device, per_step=args.sequences_per_step, packed=True,
                       float32_adapters=float32_adapters)
        variant = with_mfu(step_summary(run["seconds"], run["tokens"]), model, device)
        variant.update(memory_fields(device, run["held_bytes"], max(run["padded_tokens"])),
                       adapter_dtype=run["adapter_dtype"])
        variants[run["adapter_dtype"]] = variant
    best = max(variants.values(), key=lambda v: v["tokens_per_s"])
    on_cuda = device.type == "cuda"
    pieces = {"varlen_attention": "torch.nn.attention.varlen.varlen_attn" if on_cuda and varlen_attn is not None
              else "scaled_dot_product_attention per sequence (no varlen kernel here)",
              "liger": "RMSNorm, RoPE, SwiGLU, fused linear cross-entropy" if liger is None else f"no: {liger}",
              "optimizer": "AdamW(fused=True)" if on_cuda else "AdamW"}
    result = {**best, "variants": {k: {n: v[n] for n in ("tokens_per_s", "median_step_s", "peak_memory_bytes")}
                                   for k, v in variants.items()},
              "pieces": pieces, "sequences_per_step": args.sequences_per_step}
    if args.profile:   # the bf16 adapters' steps (the faster on both 2026-12-04 leases)
        write(args, result)
        bf16 = next((v for k, v in variants.items() if "float32" not in k), best)
        result["profile"] = profile_peer(args, model, timed, device, packed=True, float32_adapters=False,
                                         median_step_s=bf16["median_step_s"])
    return result


def peft_worker(args: argparse.Namespace, device: torch.device) -> dict:
    """One of (c)'s processes: (a) for one job, its timed steps started when all 4 are ready (a file barrier)."""
    from peft_baselines import run_jobs
    model = random_model(args.shape, device, compute_dtype(device))
    batches = the_batches(args)[args.job]
    timed = {args.job: [s for b in batches[args.warmup:args.warmup + args.steps] for s in b]}
    warm = [s for b in batches[:args.warmup] for s in b]
    clock: dict = {}

    def barrier() -> None:
        (args.barrier / f"ready-{args.job}").touch()
        deadline = time.monotonic() + 600
        while len(list(args.barrier.glob("ready-*"))) < JOBS:
            if list(args.barrier.glob("failed-*")):
                raise RuntimeError("another process of (c) failed before its steps")
            if time.monotonic() > deadline:
                raise TimeoutError("the other processes of (c) did not get ready within 600 s")
            time.sleep(0.02)
        clock["start"] = time.time()

    try:
        run = run_jobs(model, timed, warm, device, per_step=args.sequences_per_step, packed=False,
                       before_timed=barrier)
    except BaseException:
        (args.barrier / f"failed-{args.job}").touch()   # the others stop waiting for this one
        raise
    sync(device)
    end = time.time()
    result = step_summary(run["seconds"], run["tokens"])
    result.update(memory_fields(device, run["held_bytes"], max(run["padded_tokens"])), start=clock["start"], end=end,
                  matmul_parameters=matmul_parameters(model))
    return result


def concurrent_side(args: argparse.Namespace, device: torch.device) -> dict:
    """(c) 4 processes of (a) at once, one job each: total real tokens over the wall time from the moment all
    were ready to the last one's end."""
    with tempfile.TemporaryDirectory(prefix="lora-mfu-c-") as folder:
        folder = Path(folder)
        workers, logs = [], []
        for job in range(JOBS):
            command = [sys.executable, str(Path(__file__).with_name("lora_mfu.py")), "--side", "peft-worker",
                       "--job", str(job), "--barrier", str(folder), "--result", str(folder / f"{job}.json"),
                       "--shape", args.shape, "--device", args.device, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--sequences-per-step", str(args.sequences_per_step)]
            logs.append((folder / f"{job}.log").open("w+"))
            workers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=logs[-1]))
        for worker in workers:
            worker.wait()
        errors = []
        for handle in logs:
            handle.seek(0)
            errors.append(handle.read())
            handle.close()
        results = [json.loads((folder / f"{job}.json").read_text()) if (folder / f"{job}.json").is_file() else None
                   for job in range(JOBS)]
    failed = [f"process {job} (exit {w.returncode}): {errors[job][-800:]}" for job, w in enumerate(workers)
              if w.returncode != 0 or results[job] is None]
    if failed:
        raise RuntimeError("(c): " + "; ".join(failed))
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    result = {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "processes": JOBS,
              "sequences_per_step": args.sequences_per_step,
              "median_step_s": statistics.median(r["median_step_s"] for r in results),
              "p10_step_s": min(r["p10_step_s"] for r in results), "p90_step_s": max(r["p90_step_s"] for r in results),
              "steps": sum(r["steps"] for r in results),
              "peak_memory_bytes": sum(r["peak_memory_bytes"] or 0 for r in results) or None,
              "per_process": [{k: r[k] for k in ("tokens_per_s", "median_step_s", "peak_memory_bytes")}
                              for r in results]}
    flops = 4 * results[0]["matmul_parameters"] * result["tokens_per_s"]
    from lora_bench import peak_flops
    peak = peak_flops(device) if device.type == "cuda" else None
    return {**result, "flops_per_s": flops, "lora_mfu": flops / peak if peak else None, "peak_flops": peak}


# -- the frozen base and the matmul ceiling ---------------------------------------------------------------------

def matmul_ceilings(device: torch.device, shape: str) -> dict:
    """TFLOP/s of bf16 matrix products on this card: 8192^3 and the shape's gate/up GEMM over 4096 rows, each
    the median of 10 timed products after 3 warm-ups, on random data (zeros run faster)."""
    config = SHAPES[shape]
    on_cuda = device.type == "cuda"
    scale = 1 if on_cuda else 32   # a CPU dry run: the same code on small matrices
    sizes = {"8192^3": (8192 // scale, 8192 // scale, 8192 // scale),
             f"4096x{config['hidden_size']}x{config['intermediate_size']}":
                 (4096 // scale, config["hidden_size"], config["intermediate_size"])}
    out = {}
    for name, (m, k, n) in sizes.items():
        a = torch.randn(m, k, device=device, dtype=compute_dtype(device))
        b = torch.randn(k, n, device=device, dtype=compute_dtype(device))
        times = []
        for rep in range(13):
            clock = StepClock(device)
            clock.mark()
            a @ b
            clock.mark()
            if rep >= 3:
                times.append(clock.seconds()[0])
        out[name] = 2 * m * k * n / statistics.median(times)
        del a, b
    return out


def frozen_side(args: argparse.Namespace, device: torch.device) -> dict:
    """The frozen base over each aspen step's packed tokens (8 sequences, one row, the varlen attention):
    forward, logits at the target positions, input-gradient backward, no LoRA."""
    from peft_baselines import PACKED_ATTENTION, packed_tensors
    ceilings = matmul_ceilings(device, args.shape)
    model = random_model(args.shape, device, compute_dtype(device)).requires_grad_(False)
    model.set_attn_implementation(PACKED_ATTENTION)
    batches = the_batches(args)
    steps = [[s for job in range(JOBS) for s in batches[job][step]] for step in range(args.warmup + args.steps)]

    def step(batch) -> int:
        inputs = packed_tensors(batch, device)
        labels = [label for _, targets in batch for label in [-100, *targets[1:]]]   # packed_tensors' (on the host)
        where = torch.tensor([i for i in range(len(labels) - 1) if labels[i + 1] != -100]).to(device)
        targets = torch.tensor([label for label in labels[1:] if label != -100]).to(device)
        embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
        hidden = model.model(inputs_embeds=embeds, position_ids=inputs["position_ids"], use_cache=False)[0]
        logits = model.lm_head(hidden[0, where])
        torch.nn.functional.cross_entropy(logits.float(), targets).backward()
        return len(labels)

    for batch in steps[:args.warmup]:
        step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock, tokens = StepClock(device), []
    clock.mark()
    for batch in steps[args.warmup:]:
        tokens.append(step(batch))
        clock.mark()
    result = with_mfu(step_summary(clock.seconds(), tokens), model, device, ceilings["8192^3"])
    result.update(memory_fields(device), matmul_ceilings=ceilings)
    write(args, result)
    if args.profile:
        from profile_step import profile_steps as profile
        result["profile"] = profile(lambda: step(steps[-1]), device, 2, args.profile,
                                    median_step_s=result["median_step_s"])
    return result


# -- fusion -----------------------------------------------------------------------------------------------------

SIDE_FUNCTIONS = {"aspen": aspen_side, "graphs": graphs_side, "peft": peft_side, "packed": packed_side,
                  "concurrent": concurrent_side, "peft-worker": peft_worker, "frozen": frozen_side,
                  "fusion": fusion_side}   # (fusion_side.py)


def run_side(args: argparse.Namespace) -> int:
    if args.side not in SIDE_FUNCTIONS:
        raise SystemExit(f"unknown side {args.side}")
    device = torch.device(args.device)
    started = time.perf_counter()
    result = SIDE_FUNCTIONS[args.side](args, device)
    result["side_wall_s"] = round(time.perf_counter() - started, 1)
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write(args, result)
    return 0

