"""The jobs and sequences the fusion benchmarks train (bench/fusion.py, bench/fusion_operations.py,
bench/grouping.py): one LoRA setting, jobs that never finish, random token sequences, and the benchmarks' log."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from actors.data import IGNORE_INDEX, Example
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = LoraConfig(r=8, alpha=16.0, dropout=0.0, target_modules=TARGET_MODULES)
LR = 3e-4
MAX_GRAD_NORM = 1.0


def job_spec(name: str, fmt, batch_size: int) -> JobSpec:
    # max_steps far away and a constant schedule: the jobs never finish and the lr never decays to 0.
    return JobSpec(name=name, data=Path(f"bench/{name}"), format=fmt, lora=LORA, batch_size=batch_size,
                   lr=LR, lr_schedule="constant", max_grad_norm=MAX_GRAD_NORM, max_steps=10**9)


def synthetic_example(rng: random.Random, length: int, vocab: int, prompt_fraction: float = 0.5) -> Example:
    """Random tokens; the first `prompt_fraction` are prompt (no target), the rest response (targets)."""
    ids = tuple(rng.randrange(3, vocab) for _ in range(length))
    prompt = max(1, int(length * prompt_fraction))
    labels = tuple([IGNORE_INDEX] * prompt) + ids[prompt:]
    return Example(ids, labels)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fmt_pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def log(msg: str) -> None:
    print(msg, flush=True)
