#!/usr/bin/env python
"""LoRA-MFU, aspen against PEFT, and fusion efficiency on a Llama-3.1-8B-shaped base (random weights: the speed
does not depend on the values), for the GPU suite's parts `mfu` and `fusion8b`.

  mfu      trained tokens/s of 4 jobs fused by aspen's engine (bf16, packed, mixed sequence lengths
           64-768) as a share of the device's dense bf16 peak, counting 4 x (matmul parameters) FLOPs per
           trained token (forward, plus the input gradient; the frozen weights get no weight gradient):
           "LoRA-MFU". Beside it PEFT training the same 4 jobs one after another on the same base (padded
           batches, attention mask, the model's own loss), in a process of its own: the ratio of effective
           (real) tokens/s. Goals on an H100: LoRA-MFU >= 45% (LoRAFusion's 14,875 tokens/s for
           Llama-3.1-8B), >= 2x PEFT.
  fusion   tokens/s of one fused step with 1, 2, 4, 8, 16, 32 adapters at equal total tokens (32 sequences of
           128 tokens split evenly over the jobs), as a ratio to 1 adapter. Goal: >= 0.95 at 8.

    python bench/lora_mfu.py [--parts mfu,fusion] [--shape llama-3.1-8b] [--steps 6] [--json PATH]
    python bench/lora_mfu.py --shape tiny --device cpu --steps 2      # a dry run on a CPU

Needs torch, transformers and peft only (no Ray): it runs on the GPU machine's image as it is."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

SHAPES = {   # LlamaConfig fields
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
}
# dense bf16 peak FLOP/s without sparsity, from the vendors' data sheets
PEAKS = {"H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 PCIe": 756.0e12, "H100 NVL": 835.0e12,
         "H200": 989.4e12, "A100": 312.0e12, "L40S": 362.0e12}
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
# 4 jobs x 2 sequences of 64-768 tokens: 2.0k-3.9k tokens a fused step. On an H100 (2026-11-27) a step took
# ~13 MB a token for this shape (bf16 layers ~6.5 MB, the adapted modules' inputs cast to the adapters'
# float32 ~5 MB, the 128k-vocabulary logits ~1.5 MB): 4 x 4 sequences of 64-1024 (~8.7k tokens) and
# 4 x 2 of 64-1024 (up to 5.5k) ran out of the 80 GB beside the 16 GB base
JOBS, SEQUENCES_PER_JOB, MIN_LEN, MAX_LEN = 4, 2, 64, 768
RESULT = "RESULT "


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    with torch.device(device):   # built in `dtype` on the device: no float32 copy of an 8B model
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[shape]), dtype=dtype)
    return model.eval()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAKS.items() if key in name), None)


def matmul_parameters(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def job_batches(job: int, steps: int, vocab: int) -> list[list[tuple[list[int], list[int]]]]:
    """Each step's micro-batch of one job: SEQUENCES_PER_JOB sequences of MIN_LEN..MAX_LEN tokens, the first
    quarter prompt (labels -100)."""
    rng = random.Random(job)
    batches = []
    for _ in range(steps):
        batch = []
        for _ in range(SEQUENCES_PER_JOB):
            length = rng.randint(MIN_LEN, MAX_LEN)
            ids = [rng.randrange(3, vocab) for _ in range(length)]
            batch.append((ids, [-100] * (length // 4) + ids[length // 4:]))
        batches.append(batch)
    return batches


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def aspen_side(shape: str, device: torch.device, steps: int, warmup: int) -> dict:
    """4 jobs fused, every step all four (packed): real tokens/s over the timed steps."""
    from actors.engine.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.spec import JobSpec
    from actors.engine.trainer import FusedTrainer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    base = from_module(model, None)
    trainer = FusedTrainer(base, step_tokens=1 << 17)
    vocab = SHAPES[shape]["vocab_size"]
    for job in range(JOBS):
        examples = [Example(tuple(ids), tuple(labels)) for batch in job_batches(job, warmup + steps, vocab)
                    for ids, labels in batch]
        spec = JobSpec(name=f"job-{job}", data="unused.jsonl", format={"type": "text"}, batch_size=SEQUENCES_PER_JOB,
                       max_steps=warmup + steps, lr=1e-4, lora=LORA, max_seq_len=MAX_LEN)
        trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=job))
    for _ in range(warmup):
        trainer.train_step()
    sync(device)
    started, tokens = time.perf_counter(), 0
    for _ in range(steps):
        report = trainer.train_step()
        tokens += report.tokens - report.padding_tokens
    sync(device)
    seconds = time.perf_counter() - started
    peak = peak_flops(device)
    flops = 4 * matmul_parameters(model) * tokens / seconds
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "flops_per_s": flops,
            "lora_mfu": flops / peak if peak else None, "peak_flops": peak,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def peft_side(shape: str, device: torch.device, steps: int, warmup: int) -> dict:
    """The same 4 jobs, one after another, each a PEFT model over the same base: padded batches."""
    from peft import LoraConfig, get_peft_model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(shape, device, dtype)
    vocab = SHAPES[shape]["vocab_size"]
    tokens, seconds = 0, 0.0
    for job in range(JOBS):
        peft_model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                      target_modules="all-linear"), adapter_name=f"job-{job}")
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
        for step, batch in enumerate(job_batches(job, warmup + steps, vocab)):
            if step == warmup:
                sync(device)
                started = time.perf_counter()
            longest = max(len(ids) for ids, _ in batch)
            ids = torch.tensor([i + [0] * (longest - len(i)) for i, _ in batch], device=device)
            labels = torch.tensor([label + [-100] * (longest - len(label)) for _, label in batch], device=device)
            mask = torch.tensor([[1] * len(i) + [0] * (longest - len(i)) for i, _ in batch], device=device)
            loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in peft_model.parameters() if p.requires_grad], 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                tokens += sum(len(i) for i, _ in batch)
        sync(device)
        seconds += time.perf_counter() - started
        model = peft_model.unload()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def fusion_side(shape: str, device: torch.device, steps: int, warmup: int) -> dict:
    """One fused step's tokens/s with N adapters at equal total tokens, as a ratio to 1 adapter."""
    from actors.engine.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.spec import JobSpec
    from actors.engine.trainer import FusedTrainer
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = from_module(random_model(shape, device, dtype), None)
    vocab = SHAPES[shape]["vocab_size"]
    rng = random.Random(0)
    sequences, length = 32, 128 if device.type == "cuda" else 64   # 4096 tokens a step on a GPU (8192 ran out)
    rates = {}
    for adapters in (1, 2, 4, 8, 16, 32):
        trainer = FusedTrainer(base, step_tokens=1 << 17)
        per_job = sequences // adapters
        jobs = []
        for job in range(adapters):
            examples = []
            for _ in range(per_job * (warmup + steps)):
                ids = [rng.randrange(3, vocab) for _ in range(length)]
                examples.append(Example(tuple(ids), tuple(ids)))
            spec = JobSpec(name=f"f{adapters}-{job}", data="unused.jsonl", format={"type": "text"}, batch_size=per_job,
                           max_steps=warmup + steps, lr=1e-4, lora=LORA)
            jobs.append(TrainingJob.create(spec, base, examples, [], seed=job))
            trainer.add_job(jobs[-1])
        for _ in range(warmup):
            trainer.train_step()
        sync(device)
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        sync(device)
        rates[adapters] = sequences * length * steps / (time.perf_counter() - started)
        for job in jobs:
            trainer.remove_job(job.name)
    return {"tokens_per_s": rates, "efficiency": {n: rate / rates[1] for n, rate in rates.items()}}


def own_process(side: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--side", side, "--shape", args.shape, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        raise SystemExit(f"the {side} side failed (exit {out.returncode})")
    return json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith(RESULT))[len(RESULT):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="mfu,fusion")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--side", choices=("aspen", "peft", "fusion"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.side:
        run = {"aspen": aspen_side, "peft": peft_side, "fusion": fusion_side}[args.side]
        print(RESULT + json.dumps(run(args.shape, device, args.steps, args.warmup)), flush=True)
        return 0
    parts = set(args.parts.split(","))
    results: dict = {"shape": args.shape, "device": str(device), "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if "mfu" in parts:
        aspen = own_process("aspen", args)
        peft = own_process("peft", args)
        results["mfu"] = {"aspen": aspen, "peft": peft, "versus_peft": aspen["tokens_per_s"] / peft["tokens_per_s"]}
        mfu = aspen["lora_mfu"]
        print(f"LoRA-MFU: {aspen['tokens_per_s']:.0f} trained tokens/s of 4 fused jobs = "
              f"{'n/a (no peak known for this device)' if mfu is None else f'{mfu:.1%} of dense bf16 peak'} "
              f"(goal >= 45%); PEFT one job at a time {peft['tokens_per_s']:.0f} tokens/s: "
              f"aspen/PEFT {results['mfu']['versus_peft']:.2f}x (goal >= 2)", flush=True)
    if "fusion" in parts:
        fusion = own_process("fusion", args)
        results["fusion"] = fusion
        print("fusion efficiency: " + ", ".join(f"{n}: {value:.3f}" for n, value in fusion["efficiency"].items())
              + " (goal >= 0.95 at 8)", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
