#!/usr/bin/env python
"""The CPU's price for fused MoE jobs that train bit for bit as alone: a fused step of 4 jobs on a random-weight
OLMoE-shaped model, its experts computed job by job (aspen's `aspen_segments`, actors/engine/moe_experts.py)
against transformers' grouped product over all of the step's rows (`grouped_mm`, what a CPU would run without
it). The two modes alternate step by step in one process (same model, same jobs, same batches); printed: each
one's median seconds a step and their ratio.

    PYTHONPATH=. python bench/moe_experts.py [--steps 6] [--experts 16] [--top-k 4] [--json FILE]
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
from transformers import AutoModelForCausalLM, OlmoeConfig

from actors.data import TextFormat
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.moe_experts import EXPERTS_NAME
from actors.engine.trainer import FusedTrainer
from bench.fusion_jobs import job_spec, synthetic_example

VOCAB = 2048


def trainer(experts: int, top_k: int) -> FusedTrainer:
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, num_experts=experts,
                         num_experts_per_tok=top_k, max_position_embeddings=512, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    base = from_module(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), None)
    fused = FusedTrainer(base, step_tokens=100_000)
    for index in range(4):
        rng = random.Random(index)
        examples = [synthetic_example(rng, rng.randrange(32, 128), VOCAB) for _ in range(256)]
        fused.add_job(TrainingJob.create(job_spec(f"job-{index}", TextFormat(), 8), fused.base, examples, [],
                                         seed=index))
    return fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    fused = trainer(args.experts, args.top_k)
    model = fused.base.model
    times: dict[str, list[float]] = {EXPERTS_NAME: [], "grouped_mm": []}
    for mode in (EXPERTS_NAME, "grouped_mm"):   # warm both
        model.set_experts_implementation(mode)
        fused.train_step()
    for _ in range(args.steps):
        for mode in times:
            model.set_experts_implementation(mode)
            started = time.perf_counter()
            fused.train_step()
            times[mode].append(time.perf_counter() - started)
    model.set_experts_implementation(EXPERTS_NAME)
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    ratio = medians[EXPERTS_NAME] / medians["grouped_mm"]
    for mode, value in medians.items():
        print(f"{mode:>14}: {value:.3f} s a step (median of {args.steps})")
    print(f"job by job / grouped: {ratio:.3f}x ({torch.get_num_threads()} threads, {args.experts} experts, "
          f"top-{args.top_k}, 4 jobs)")
    if args.json:
        args.json.write_text(json.dumps({"seconds": medians, "ratio": ratio, "experts": args.experts,
                                         "top_k": args.top_k, "steps": args.steps}, indent=2))


if __name__ == "__main__":
    main()
