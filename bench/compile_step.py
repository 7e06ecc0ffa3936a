#!/usr/bin/env python
"""Eager against compiled fused steps (`compile: default`, actors/engine/compiled.py): seconds per step, graphs
compiled, and the adapters' difference after the same steps.

Both trainers run the same steps: `--jobs` jobs, each step every job's micro-batch of `--batch` synthetic
sequences of random lengths (so the stream's length changes each step and falls into a few bucket lengths). The
compiled trainer first runs `--warmup` steps (compiling each bucket it meets); then both run `--steps` timed
steps, alternating, and the graphs compiled during the timed steps are counted (0 when the warm-up met every
bucket the timed steps use).

    python bench/compile_step.py [--base-model tiny-llama] [--backend inductor] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.backends.registry import lookup_backend

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from actors.data import Example
from actors.engine.compiled import bucket_length
from actors.engine.job import TrainingJob
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec


class CountingBackend:
    def __init__(self, inner: str):
        self.inner = lookup_backend(inner)
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        self.graphs += 1
        return self.inner(graph, example_inputs)


def example(rng: random.Random, length: int, vocab: int) -> Example:
    ids = [rng.randrange(3, vocab) for _ in range(length)]
    prompt = length // 2
    return Example(tuple(ids), tuple([-100] * prompt + ids[prompt:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="tiny-llama")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.base_model == "tiny-llama":
        sys.path.insert(0, str(REPO / "bench"))
        from fusion import tiny_llama

        device = "cuda" if torch.cuda.is_available() else "cpu"
        base = tiny_llama(torch.device(device if args.device == "auto" else args.device))
    else:
        base = load_base_model(args.base_model, dtype=args.dtype, device=args.device)
    vocab = int(base.model.config.vocab_size)
    rng = random.Random(0)
    steps = [[[example(rng, rng.randint(args.min_len, args.max_len), vocab) for _ in range(args.batch)]
              for _ in range(args.jobs)] for _ in range(args.warmup + args.steps)]
    backend = CountingBackend(args.backend)
    trainers = {"eager": FusedTrainer(base, step_tokens=10**9),
                "compiled": FusedTrainer(base, step_tokens=10**9, compile="default", compile_backend=backend)}
    jobs: dict[str, list[TrainingJob]] = {}
    for mode, trainer in trainers.items():
        jobs[mode] = []
        for index in range(args.jobs):
            spec = JobSpec(name=f"{mode}{index}", data="synthetic.jsonl", format={"type": "text"},
                           batch_size=args.batch, max_steps=10**6, lr=1e-3, lr_schedule="constant", warmup_steps=0,
                           lora={"r": 8, "alpha": 16, "target_modules": "all-linear"})
            job = TrainingJob.create(spec, base, steps[0][0], [], seed=index)
            trainer.add_job(job)
            jobs[mode].append(job)

    def run(mode: str, step: list[list[Example]]) -> float:
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        started = time.perf_counter()
        trainers[mode].run_step(list(zip(jobs[mode], step, strict=True)))
        if base.device.type == "cuda":
            torch.cuda.synchronize(base.device)
        return time.perf_counter() - started

    started = time.perf_counter()
    for step in steps[:args.warmup]:
        run("eager", step)
        run("compiled", step)
    warmup_s = time.perf_counter() - started
    warmup_graphs = backend.graphs
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for index, step in enumerate(steps[args.warmup:]):
        for mode in (("eager", "compiled") if index % 2 == 0 else ("compiled", "eager")):
            times[mode].append(run(mode, step))
    difference = max(float((a - b).abs().max()) for eager_job, compiled_job in zip(jobs["eager"], jobs["compiled"],
                                                                                   strict=True)
                     for (_, a), (_, b) in zip(eager_job.adapter.named_parameters(),
                                               compiled_job.adapter.named_parameters(), strict=True))
    lengths = [sum(len(e) for batch in step for e in batch) for step in steps]
    result = {"base_model": args.base_model, "device": str(base.device), "dtype": str(base.dtype),
              "backend": args.backend, "torch": torch.__version__, "jobs": args.jobs,
              "tokens_per_step": lengths, "buckets": sorted({bucket_length(t) for t in lengths}),
              "warmup_steps": args.warmup, "warmup_s_both": warmup_s, "graphs_in_warmup": warmup_graphs,
              "graphs_in_timed_steps": backend.graphs - warmup_graphs,
              "median_step_s": {mode: statistics.median(t) for mode, t in times.items()},
              "compiled_over_eager": statistics.median(times["compiled"]) / statistics.median(times["eager"]),
              "max_adapter_difference": difference}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
