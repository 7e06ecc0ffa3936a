#!/usr/bin/env python
"""A GRPO job learning beside SFT jobs on one base (issue 37): smollm2-135m (the embedded default), one fused
trainer, the in-process service (`train_locally`, as `aspen run` runs a jobs file):

- `arith` (method grpo): generated single-digit additions asked in chat form, after three solved ones as
  earlier turns ("What is 2+3?" "5", ...; format chat with mask_history: the sum of the last question is
  the only target), 8 completions per prompt sampled with its own adapter each step, rewarded by the built-in
  exact_match (1 where the completion is exactly the sum, else 0); 24 held-out additions (never trained on)
  scored by greedy generation before (the base alone) and after (its adapter): exact match and contains;
- `reverse` and `date` (method sft): two of the demo's generated tasks, sharing the same fused steps.

Printed: the held-out exact-match score of the base alone and of the GRPO job's adapter (the same greedy
decoding), its mean training reward per step, and the SFT jobs' first and last losses. The claim is that the
held-out score rises above the base's while the SFT jobs train.

    .venv/bin/python bench/grpo.py [--steps 40] [--lr 1e-4] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QUESTION = "What is {a}+{b}?"
SHOTS = ((2, 3), (4, 4), (6, 1))   # earlier turns of every conversation: how an answer looks (a bare number)


def arithmetic_rows(count: int, seed: int, exclude: set[tuple[int, int]] = frozenset()) -> list[dict]:
    """Chat rows of distinct single-digit additions (not in `exclude`, nor among the shots): three solved
    additions as earlier turns, then the question; the sum is the last assistant turn (the only target, with
    the chat format's mask_history)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10) if (a, b) not in exclude and (a, b) not in SHOTS]
    rng.shuffle(pairs)
    shots = [turn for a, b in SHOTS for turn in ({"role": "user", "content": QUESTION.format(a=a, b=b)},
                                                 {"role": "assistant", "content": str(a + b)})]
    return [{"messages": [*shots, {"role": "user", "content": QUESTION.format(a=a, b=b)},
                          {"role": "assistant", "content": str(a + b)}], "pair": [a, b]} for a, b in pairs[:count]]


def held_out_samples(base, examples) -> dict[str, list[str]]:
    """What the base alone and the GRPO adapter answer (greedy, 8 tokens, special tokens shown) to a few
    held-out prompts."""
    from actors.engine.generate import greedy_generate_many
    from actors.engine.generation_eval import scored_rows, stop_token_ids

    rows = scored_rows(examples, base, None)
    out = {}
    for who, adapter in (("base", None), ("grpo", "arith")):
        tokens = greedy_generate_many(base, [(adapter, list(r.prompt)) for r in rows], 8, stop_token_ids(base))
        out[who] = [repr(base.tokenizer.decode(t)) for t in tokens]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-4, help="the GRPO job's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="which additions are held out and trained on, and the "
                                                                "jobs' seed (sampling, initialisation)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from actors.checkpoint.peft_io import load_adapter_weights
    from actors.data.formats import ChatFormat
    from actors.data.tokenize import tokenize_example
    from actors.engine.adapter_surgery import add_adapter
    from actors.engine.generation_eval import generation_scores
    from actors.engine.models import load_base_model
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.evaluation_config import GenerationEval
    from actors.spec.lora_config import LoraConfig
    from actors.spec.run_spec import RunSpec
    from orchestrator.demo import TASKS, make_rows, write_jsonl

    held_out = arithmetic_rows(24, seed=1 + 2 * args.seed)
    train = arithmetic_rows(57, seed=2 + 2 * args.seed, exclude={tuple(row["pair"]) for row in held_out})
    lora = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
    metrics = [GenerationEval(metric=name, max_new_tokens=8) for name in ("exact_match", "contains")]
    with tempfile.TemporaryDirectory(prefix="aspen-grpo-") as scratch:
        folder = Path(scratch)
        arith = write_jsonl(folder / "arith.jsonl", [{"messages": r["messages"]} for r in train])
        sft = {task.name: write_jsonl(folder / f"{task.name}.jsonl", make_rows(task, 200, seed=0))
               for task in TASKS if task.name in ("reverse", "date")}
        jobs = [{"name": "arith", "data": str(arith), "format": {"type": "chat", "mask_history": True},
                 "method": "grpo", "grpo": {"reward": "exact_match", "num_generations": 8, "max_new_tokens": 8},
                 "batch_size": 4, "max_steps": args.steps, "lr": args.lr, "max_seq_len": 160, "lora": lora}]
        for task in TASKS:
            if task.name in sft:
                jobs.append({"name": task.name, "data": str(sft[task.name]), "format": task.format.model_dump(),
                             "batch_size": 4, "max_steps": args.steps, "lr": 2e-4, "max_seq_len": 64, "lora": lora})
        spec = RunSpec.model_validate({"base_model": "smollm2-135m", "output_dir": str(folder / "runs"),
                                       "step_tokens": 8192, "dtype": "float32", "seed": args.seed,
                                       "jobs": jobs})
        base = load_base_model("smollm2-135m", dtype="float32", device="cpu")
        chat = ChatFormat(type="chat", mask_history=True)
        held = [tokenize_example({"messages": r["messages"]}, chat, base.tokenizer, max_seq_len=160) for r in held_out]
        base_scores = generation_scores(base, [(None, metric, held) for metric in metrics])
        started = time.time()
        results = {r.name: r for r in train_locally(spec, base=base, progress=False)}
        seconds = time.time() - started
        handle = add_adapter(base.model, "arith", LoraConfig(**lora), seed=0)
        load_adapter_weights(handle, Path(results["arith"].adapter_dir))
        grpo_scores = generation_scores(base, [("arith", metric, held) for metric in metrics])
        samples = held_out_samples(base, held[:4])
        rows = [json.loads(line) for line in (Path(results["arith"].adapter_dir) / "metrics.jsonl").read_text()
                .splitlines()]
    rewards = [round(row["reward"], 3) for row in rows]
    figures = {"held_out": {"base": dict(zip(("exact_match", "contains"), base_scores, strict=True)),
                            "grpo": dict(zip(("exact_match", "contains"), grpo_scores, strict=True))},
               "grpo_train_reward_per_step": rewards, "seconds": round(seconds, 1),
               "sft": {name: {"first_loss": r.first_loss, "final_loss": r.final_loss, "state": r.state}
                       for name, r in results.items() if name != "arith"},
               "grpo_state": results["arith"].state}
    for who, values in figures["held_out"].items():
        print(f"held-out, {who:>4}: exact match {values['exact_match']:.3f}, contains {values['contains']:.3f}")
    print(f"GRPO job, mean training reward per step: {rewards}")
    for who, texts in samples.items():
        print(f"held-out answers, {who}: {', '.join(texts)}")
    figures["held_out_samples"] = samples
    for name, row in figures["sft"].items():
        print(f"SFT job {name}: loss {row['first_loss']:.3f} -> {row['final_loss']:.3f} ({row['state']})")
    print(f"{args.steps} fused steps in {seconds:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
