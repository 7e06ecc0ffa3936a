#!/usr/bin/env python
"""Step time of grouped against per-segment LoRA on this machine (the choice of `lora_grouped.GROUPING`'s auto):
fused training steps (forward, backward, optimizer steps, through `FusedTrainer.run_step`) of 1, 4 and 8
jobs at equal total tokens, on random-weight models built from configs (a tiny Llama, and one shaped like
SmolLM2-135M: 30 layers, hidden 576), both ways alternated step by step in one process; the median of
each way's step times and the median of the per-round ratios (grouped / per segment: below 1 is faster).

    PYTHONPATH=. python bench/grouping.py [--models tiny,smollm2] [--adapters 1,4,8] [--steps 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
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
from actors.engine import lora_grouped
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from bench.fusion_jobs import job_spec, synthetic_example

COMMON = dict(tie_word_embeddings=False, pad_token_id=2, bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
MODELS = {
    # (config, sequences per step, tokens per sequence)
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2), 8, 32),
    "smollm2": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3), 8, 128),
}


def measure(name: str, adapters: list[int], steps: int) -> dict:
    import random

    config, count, length = MODELS[name]
    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(LlamaConfig(**config, **COMMON)).eval(), None)
    rng = random.Random(7)
    sequences = [synthetic_example(rng, length, config["vocab_size"]) for _ in range(count)]
    saved = lora_grouped.GROUPING
    rows = {}
    try:
        for n in adapters:
            per_job = count // n
            setups = {}
            for mode in ("grouped", "segments"):
                trainer = FusedTrainer(base, step_tokens=10**9, layout="packed")
                chosen = []
                for index in range(n):
                    job = TrainingJob.create(job_spec(f"{mode}-{n}-{index}", TextFormat(), per_job), base, sequences,
                                             [], seed=index)
                    trainer.add_job(job)
                    chosen.append((job, sequences[index * per_job:(index + 1) * per_job]))
                setups[mode] = (trainer, chosen)
            times: dict[str, list[float]] = {"grouped": [], "segments": []}
            for step in range(steps + 1):
                order = ("grouped", "segments") if step % 2 else ("segments", "grouped")
                for mode in order:
                    lora_grouped.GROUPING = mode
                    trainer, chosen = setups[mode]
                    started = time.perf_counter()
                    trainer.run_step(chosen)
                    if step:   # the first step of each way warms up (optimizer state, allocator)
                        times[mode].append(time.perf_counter() - started)
            for trainer, chosen in setups.values():
                for job, _ in chosen:
                    trainer.remove_job(job.name)
            rows[str(n)] = {"grouped_median_s": statistics.median(times["grouped"]),
                            "segments_median_s": statistics.median(times["segments"]),
                            "grouped_over_segments": statistics.median(
                                g / s for g, s in zip(times["grouped"], times["segments"], strict=True)),
                            "times_s": times}
            r = rows[str(n)]
            print(f"{name:8s} {n:2d} adapters, {count} x {length} tokens: grouped {r['grouped_median_s']:.4f}s, "
                  f"per segment {r['segments_median_s']:.4f}s, grouped / per segment {r['grouped_over_segments']:.3f}",
                  flush=True)
    finally:
        lora_grouped.GROUPING = saved
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--adapters", default="1,4,8")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per way (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    adapters = [int(n) for n in args.adapters.split(",")]
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(),
               "models": {name: measure(name, adapters, args.steps) for name in args.models.split(",")}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
