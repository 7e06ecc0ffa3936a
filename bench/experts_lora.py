#!/usr/bin/env python
"""LoRA on an MoE base's experts: aspen's 4 jobs fused against PEFT's `target_parameters` training the same 4 jobs
one after another, each side in a process of its own, on a random-weight OLMoE-shaped model (CPU, float32).

Both sides train the same adapters (rank 8 on q/k/v/o and on both expert stacks, alpha 16) on the same sequences
(32-128 tokens, 8 a job's step) for the same optimizer steps. PEFT's side is set up as a careful user would: a
job's sequences sorted by length so that a step pads little, an attention mask, AdamW with `foreach`, one model
loaded once and a fresh adapter per job. aspen's side: one `FusedTrainer` holding the 4 jobs, packed. Printed: each
side's real tokens per second over its timed steps (after one warm-up step a job), its peak resident set, and
aspen / PEFT; the sides alternate for `--rounds` rounds (a shared machine's speed drifts by more than the sides
differ) and the median of the rounds' ratios is the figure.

    PYTHONPATH=. python bench/experts_lora.py [--steps 4] [--rounds 3] [--no-stacks] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VOCAB, JOBS, PER_STEP = 2048, 4, 8
STACKS = ["experts.gate_up_proj", "experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_model():
    import torch
    from transformers import AutoModelForCausalLM, OlmoeConfig

    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, num_experts=16, num_experts_per_tok=4,
                         max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def job_sequences(job: int, steps: int) -> list[list[int]]:
    rng = random.Random(job)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(32, 129))] for _ in range((steps + 1) * PER_STEP)]


def aspen_side(steps: int, stacks: list[str]) -> dict:
    from actors.data import Example, TextFormat
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.spec.job_spec import JobSpec

    base = from_module(build_model(), None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    for job in range(JOBS):
        examples = [Example(tuple(ids), tuple(ids)) for ids in job_sequences(job, steps)]
        spec = JobSpec(name=f"job-{job}", data="-", format=TextFormat(), batch_size=PER_STEP, max_steps=steps + 1,
                       lr=1e-4, warmup_steps=0, lora={"r": 8, "alpha": 16, "target_modules": ATTENTION,
                                                       "target_parameters": stacks})
        trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=job))
    trainer.train_step()   # warm-up: every job's first step
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        report = trainer.train_step()
        tokens += sum(result.tokens for result in report.results)
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def peft_side(steps: int, stacks: list[str]) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    model = build_model()
    tokens, seconds = 0, 0.0
    for job in range(JOBS):
        peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION,
                                                      target_parameters=stacks or None))
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4,
                                      foreach=True)
        sequences = sorted(job_sequences(job, steps), key=len)
        batches = [sequences[i:i + PER_STEP] for i in range(0, len(sequences), PER_STEP)]
        random.Random(job).shuffle(batches)
        for index, batch in enumerate(batches):
            longest = max(len(ids) for ids in batch)
            ids = torch.tensor([ids + [0] * (longest - len(ids)) for ids in batch])
            mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in batch])
            labels = ids.masked_fill(mask == 0, -100)
            start = time.perf_counter()
            loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if index:   # the first step of a job warms up
                seconds += time.perf_counter() - start
                tokens += sum(len(ids) for ids in batch)
        model = peft_model.unload()
    return {"tokens": tokens, "seconds": seconds}


def run_side(side: str, steps: int, stacks: bool) -> dict:
    done = subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(steps)]
                          + ([] if stacks else ["--no-stacks"]), capture_output=True,
                          text=True, check=False, env={"PYTHONPATH": str(REPO), **__import__("os").environ})
    if done.returncode != 0:
        raise SystemExit(f"the {side} side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per job")
    parser.add_argument("--no-stacks", dest="stacks", action="store_false",
                        help="attention alone on both sides: what the MoE base itself costs each side")
    parser.add_argument("--rounds", type=int, default=3, help="the sides alternate this many times")
    parser.add_argument("--side", choices=["aspen", "peft"], help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.side:
        stacks = STACKS if args.stacks else []
        result = aspen_side(args.steps, stacks) if args.side == "aspen" else peft_side(args.steps, stacks)
        result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(result))
        return
    rounds = []
    for number in range(1, args.rounds + 1):
        sides = {side: run_side(side, args.steps, args.stacks) for side in ("aspen", "peft")}
        for side, result in sides.items():
            result["tokens_per_s"] = result["tokens"] / result["seconds"]
            print(f"round {number}  {side:5}  {result['tokens']} tokens in {result['seconds']:.1f} s: "
                  f"{result['tokens_per_s']:.0f} tokens/s; peak resident {result['peak_rss_bytes'] / 2**30:.2f} GiB")
        sides["ratio"] = sides["aspen"]["tokens_per_s"] / sides["peft"]["tokens_per_s"]
        rounds.append(sides)
    ratios = [r["ratio"] for r in rounds]
    print(f"aspen / PEFT (tokens/s), each round: {', '.join(f'{r:.2f}' for r in ratios)}; median "
          f"{statistics.median(ratios):.2f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "ratio": statistics.median(ratios)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
