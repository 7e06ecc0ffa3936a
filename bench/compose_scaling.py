#!/usr/bin/env python
"""The host's time to compose one fused step as a trainer loop composes it (`FusedTrainer.compose` under the
memory budget's `StepAdmission.fits`, then the step's features for the memory model), by the number of jobs, on
a random-weight model of 32 layers (as many as the 8B shape: a job's adapter is 448 tensors on all linear
layers). The GPU waits for this between two steps, so it must grow no faster than the jobs do: printed per
count, the milliseconds (median of the rounds) and the ratio to the count half as large (2.0: linear in the jobs;
4.0: quadratic).

    PYTHONPATH=. python bench/compose_scaling.py [--jobs 8,16,32,64] [--layers 32] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.data import TextFormat
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch
from actors.engine.trainer import FusedTrainer
from actors.service.trainer.step_admission import StepAdmission
from bench.fusion_jobs import job_spec, synthetic_example

VOCAB = 512


def compose_seconds(jobs: int, layers: int, rounds: int) -> float:
    """The median over `rounds` of one step's composition (and its features) with `jobs` jobs of one 128-token
    sequence each, every one joining (a budget that holds them all)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, pad_token_id=2, bos_token_id=1, eos_token_id=2))
    base = from_module(model, None)
    trainer = FusedTrainer(base, step_tokens=1 << 20)
    rng = random.Random(0)
    for index in range(jobs):
        examples = [synthetic_example(rng, 128, VOCAB) for _ in range(4)]
        trainer.add_job(TrainingJob.create(job_spec(f"job-{index}", TextFormat(), 1), base, examples, [], seed=index))
    admission = StepAdmission(trainer, budget_bytes=1 << 50)
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        chosen = trainer.compose(fits=admission.fits)
        shape = admission.shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
        admission.predict_peak(shape)
        seconds.append(time.perf_counter() - started)
        assert len(chosen) == jobs
        for job, batch in chosen:   # the same micro-batches again next round (not taken: no step runs)
            job.pending = batch
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="8,16,32,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    counts = [int(n) for n in args.jobs.split(",")]
    results = {}
    print(f"composing a step under the memory budget, {args.layers} layers, every job joining (median of "
          f"{args.rounds})", flush=True)
    for count in counts:
        results[count] = compose_seconds(count, args.layers, args.rounds)
        half = results.get(count // 2)
        ratio = f"  x{results[count] / half:.2f} over {count // 2} jobs" if half else ""
        print(f"  {count:4d} jobs: {results[count] * 1e3:8.2f} ms{ratio}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "seconds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
