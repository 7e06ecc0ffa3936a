#!/usr/bin/env python
"""A pipeline trainer against one trainer on the same cores, and the pipeline schedule simulated at 4-16 stages.

Measured (CPU): the same jobs, k at a time (k = 1, 2, 4, 8), trained by
  single    one fused trainer in one process with 2 threads (the single-device trainer);
  pipeline  2 stages, one process and one thread each (stage 0 with the head), LoRA-aware schedule;
  flush     the same 2 stages with a generic pipeline's flush at every step (every adapter steps together,
            the next global batch waits until the pipeline is empty)
  loop      the LoRA-aware pipeline as the trainer loop drives it (`stages: N` in the service and `aspen run`):
            one optimizer step of every job per loop step, drained at its end, the jobs spread over 4
            micro-batches a stage
each side in its own process, as users run them. Printed: trained tokens/s of each side and the ratio to
the single trainer (and, for scale, the single trainer with one thread), each stage's bubble share (the
share of its busy span it waited), at each k.
Goals (issue "One base over several devices"): bubble share <= 10% at >= 2 x stages jobs, and tokens/s
>= 0.9 of the single trainer's.

Simulated: the schedule alone (actors/engine/pipeline/pipeline_schedule.py) at 4, 8 and 16 stages with 1, S/2, S and 2S
jobs of equal micro-batches, forward 1 and backward 2 units per stage, a transfer of 0 or 0.1 units between
stages: each stage's mean bubble share, LoRA-aware and flushed.

Memory: each stage's predicted peak against the allocator's count, step by step (`--memory-only`).

    .venv/bin/python bench/pipeline.py [--jobs 1,2,4,8] [--steps 6] [--simulate-only] [--memory-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan, PipelineSchedule

LAYERS, HIDDEN, VOCAB = 16, 192, 8192
DROPOUT = 0.05
PLANS_PER_STAGE = 4   # as actors/service/pipeline/pipeline_engine.py sets it


def bench_base(layers: int = LAYERS, hidden: int = HIDDEN, vocab: int = VOCAB):
    """A random Llama-shaped base (16 layers of width 192, vocabulary 8192): a fused step of 4 jobs takes
    ~0.1-0.3 s on a CPU core, so compute, not messaging, dominates as it does for real bases, and 16 layers
    let two stages balance to within a layer (~6% of the work)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.engine.models import from_module
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return from_module(LlamaForCausalLM(config).eval(), None)


def bench_jobs(count: int, steps: int):
    import torch

    from actors.data import Example
    from actors.spec.job_spec import JobSpec
    jobs = []
    for index in range(count):
        generator = torch.Generator().manual_seed(index)
        examples = []
        for _ in range(4 * steps):
            length = int(torch.randint(32, 97, (1,), generator=generator))
            ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
            examples.append(Example(tuple(ids), tuple([-100] * (length // 3) + ids[length // 3:])))
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=4,
                       max_steps=steps, lr=1e-3, lora={"r": 8, "alpha": 16, "target_modules": "all-linear",
                                                       "dropout": DROPOUT if index % 2 else 0.0})
        jobs.append((spec, examples, index))
    return jobs


def run_single(count: int, steps: int, threads: int = 2) -> dict:
    import torch

    from actors.engine.job import TrainingJob
    from actors.engine.trainer import FusedTrainer
    torch.set_num_threads(threads)
    base = bench_base()
    trainer = FusedTrainer(base, step_tokens=1 << 16)
    for spec, examples, seed in bench_jobs(count, steps):
        trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=seed))
    tokens = 0
    started = time.perf_counter()
    while (report := trainer.train_step()) is not None:
        tokens += report.tokens - report.padding_tokens
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


def run_pipeline(count: int, steps: int, flush: bool, rounds: bool = False) -> dict:
    """`rounds`: as the trainer loop drives a pipeline (actors/service/pipeline/pipeline_engine.py): one optimizer step
    of every job per loop step, the stages drained at its end (so that the loop sees each job at a step
    boundary: stop verdicts, evaluations, checkpoints)."""
    from actors.engine.pipeline.stage_messages import StageSettings
    from actors.service.pipeline.pipeline_processes import LocalPipeline
    with LocalPipeline(functools.partial(bench_base), 2, split="measured", threads=1,
                       settings=StageSettings(flush=flush), step_tokens=1 << 16) as pipeline:
        for spec, examples, seed in bench_jobs(count, steps):
            pipeline.add_job(spec, examples, seed=seed)
        started = time.perf_counter()
        if rounds:
            pipeline.trainer.plans_per_stage = PLANS_PER_STAGE
            reports, heads = [], pipeline.trainer.jobs
            while not all(head.done for head in heads.values()):
                for head in heads.values():
                    head.step_limit = head.planned_steps + 1
                reports += pipeline.run()
        else:
            reports = pipeline.run()
        seconds = time.perf_counter() - started
        stats = pipeline.stats()
        split = pipeline.split
    return {"tokens": sum(r.tokens - r.padding_tokens for r in reports), "seconds": seconds,
            "bubble": [round(s["bubble_share"], 3) for s in stats], "split": split, "plans": len(reports)}


def side(name: str, count: int, steps: int) -> dict:
    """One side in its own process."""
    out = subprocess.run([sys.executable, __file__, "--side", name, "--concurrent", str(count), "--steps", str(steps)],
                         capture_output=True, text=True, check=False)   # the environment as the user has it
    if out.returncode != 0:
        raise SystemExit(f"{name} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measured(counts: list[int], steps: int) -> None:
    print(f"measured: {LAYERS} layers of width {HIDDEN}, vocabulary {VOCAB}, jobs of {steps} steps of 4 sequences "
          "(32-96 tokens), r=8 all-linear; tokens/s of real tokens trained")
    print(f"{'jobs':>4} {'1 thread':>9} {'single':>9} {'pipeline':>9} {'ratio':>6} {'bubble (stage 0, 1)':>20} "
          f"{'flush':>9} {'ratio':>6} {'bubble':>14} {'loop':>9} {'ratio':>6} {'bubble':>14} split")
    for count in counts:
        one_thread = side("single1", count, steps)
        single = side("single", count, steps)
        lora_aware = side("pipeline", count, steps)
        flushed = side("flush", count, steps)
        loop = side("loop", count, steps)
        rate = {name: result["tokens"] / result["seconds"] for name, result in
                (("single", single), ("pipeline", lora_aware), ("flush", flushed), ("loop", loop))}
        print(f"{count:>4} {one_thread['tokens'] / one_thread['seconds']:>9.0f}"
              f" {rate['single']:>9.0f} {rate['pipeline']:>9.0f} {rate['pipeline'] / rate['single']:>6.2f} "
              f"{str(lora_aware['bubble']):>20} {rate['flush']:>9.0f} {rate['flush'] / rate['single']:>6.2f} "
              f"{str(flushed['bubble']):>14} {rate['loop']:>9.0f} {rate['loop'] / rate['single']:>6.2f} "
              f"{str(loop['bubble']):>14} {lora_aware['split']}", flush=True)


def memory(count: int = 4, steps: int = 24, device: str = "cpu") -> None:
    """Each stage's predicted peak (actors/service/pipeline/pipeline_admission.py: the probe's prior, refitted on the
    measured steps) against the allocator's count over each loop step, as the trainer loop runs them. On
    `device` "cuda": one GPU each where there are two, else both stages on one (by CUDA IPC)."""
    import torch

    from actors.data import DataCursor
    from actors.engine.packing import JobMicroBatch
    from actors.service.pipeline.pipeline_admission import PipelineAdmission
    from actors.service.pipeline.pipeline_engine import start_pipeline
    from actors.service.scheduler.config import TrainerConfig
    cuda = device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
    engine = start_pipeline(TrainerConfig(stages=2, stage_split="even", step_tokens=4096, num_gpus=1 if cuda else 0),
                            functools.partial(bench_base, 8, 128, VOCAB), threads=None if cuda else 1)
    try:
        admission = PipelineAdmission(engine)
        jobs = []
        for spec, examples, seed in bench_jobs(count, steps):
            job = engine.attach(spec, DataCursor(examples, spec.batch_size, seed=seed), [], steps, seed=seed)
            engine.add_job(job)
            jobs.append(job)
        errors: list[list[float]] = [[], []]
        for step in range(steps):
            chosen = engine.compose(jobs, admission.fits)
            shape = admission.shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
            predicted = [model.predict(s) for model, s in zip(admission.models, admission.shapes, strict=True)]
            report = engine.run_step(chosen, measure=True)
            admission.observe(shape, report, max(predicted))
            if step >= 4:
                for stage, (guess, peak) in enumerate(zip(predicted, engine.last_peaks, strict=True)):
                    errors[stage].append((guess - peak) / peak)
    finally:
        engine.close()
    print(f"\nmemory model per stage on {device} (8 layers of width 128, {count} jobs, r=8 all-linear, half with "
          f"dropout; steps 5-{steps}, each stage's peak counted by the allocator)")
    for stage, values in enumerate(errors):
        mean = sum(abs(v) for v in values) / len(values)
        print(f"stage {stage}: mean |error| {mean:.3f}, worst under {min(values):+.3f}, worst over {max(values):+.3f}")


def simulate(stages: int, jobs: int, *, flush: bool, transfer: float, steps: int = 16) -> float:
    schedule = PipelineSchedule(stages, flush=flush, transfer=transfer)
    micro = {f"j{index}": 0 for index in range(jobs)}
    rotation, index = 0, 0
    per_plan = max(1, math.ceil(jobs / stages))
    while True:
        live = [job for job in micro if micro[job] < steps]
        if not live:
            break
        ordered = live[rotation % len(live):] + live[:rotation % len(live)]
        rotation += 1
        free = [job for job in ordered if not schedule.job_waits(job)]
        chosen = (free or ordered[:1])[:per_plan]
        for job in chosen:
            micro[job] += 1
        schedule.add_plan(MicroBatchPlan(index=index, jobs=tuple(chosen), closes=tuple(chosen),
                                         cost=float(len(chosen))))
        index += 1
    schedule.drain()
    return sum(schedule.bubble_share()) / stages


def simulated() -> None:
    print("\nsimulated (actors/engine/pipeline/pipeline_schedule.py): mean bubble share per stage, 16 steps per job, "
          "jobs packed ceil(jobs/S) per micro-batch")
    print(f"{'stages':>6} {'jobs':>5} {'transfer':>8} {'LoRA-aware':>10} {'flush':>7}")
    for stages in (4, 8, 16):
        for jobs in sorted({1, stages // 2, stages, 2 * stages}):
            for transfer in (0.0, 0.1):
                aware = simulate(stages, jobs, flush=False, transfer=transfer)
                flushed = simulate(stages, jobs, flush=True, transfer=transfer)
                print(f"{stages:>6} {jobs:>5} {transfer:>8.1f} {aware:>10.3f} {flushed:>7.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--memory-only", action="store_true", help="only the per-stage memory model's errors")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where --memory-only runs")
    parser.add_argument("--side", choices=("single", "single1", "pipeline", "flush", "loop"), help=argparse.SUPPRESS)
    parser.add_argument("--concurrent", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--plans-per-stage", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plans_per_stage:
        global PLANS_PER_STAGE
        PLANS_PER_STAGE = args.plans_per_stage
    if args.side:
        if args.side.startswith("single"):
            result = run_single(args.concurrent, args.steps, threads=1 if args.side == "single1" else 2)
        else:
            result = run_pipeline(args.concurrent, args.steps, flush=args.side == "flush", rounds=args.side == "loop")
        print(json.dumps(result))
        return 0
    if args.memory_only:
        memory(device=args.device)
        return 0
    if not args.simulate_only:
        measured([int(c) for c in args.jobs.split(",")], args.steps)
        memory()
    simulated()
    return 0


if __name__ == "__main__":
    sys.exit(main())
