"""Part 2 of bench/memory.py: glibc malloc's default (what a CPU trainer runs) against its mmap threshold fixed
at 64 KiB (what CPU trainers ran on 2026-11-25/26, so that the resident set followed the live tensors): step time
and the process's peak resident set of the same steps, each setting in fresh processes of its own (mallopt is
process-wide and a heap's state outlives a setting's change), alternated A-B-B-A.

    python bench/memory_malloc.py SETTING STEPS MODEL_JSON   # one process's side (bench/memory.py runs them)"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import torch

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter
MALLOC_SETTINGS = ("glibc default", "mmap threshold 64K")


def malloc_steps(setting: str, steps: int, model: dict) -> dict:
    """The same fused steps under one malloc setting, in this (fresh) process: median step time and the
    process's peak resident set. "mmap threshold 64K": every block above 64 KiB mapped on allocation and
    unmapped on free (setting it also turns glibc's dynamic threshold off)."""
    import ctypes

    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.memory import process_peak_resident_bytes
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.spec.job_spec import JobSpec

    if setting == "mmap threshold 64K" and ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise RuntimeError("glibc refused mallopt(M_MMAP_THRESHOLD, 64 KiB)")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = from_module(LlamaForCausalLM(LlamaConfig(**model)), None)
    length = 256
    example = Example(tuple(range(3, 3 + length)), tuple([-100] * 80 + list(range(83, 3 + length))))
    trainer = FusedTrainer(base, step_tokens=10**6)
    for j in range(2):
        spec = JobSpec(name=f"m{j}", data="-", format={"type": "text"}, batch_size=4, max_steps=steps + 2,
                       warmup_steps=0, lora={"r": 16, "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, [example] * 4, [], seed=j))
    trainer.train_step()
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train_step()
        seconds.append(time.perf_counter() - started)
    return {"setting": setting, "median_step_s": statistics.median(seconds), "steps": steps,
            "peak_resident_bytes": process_peak_resident_bytes()}


def malloc_side_by_side(steps: int, env: dict, model: dict) -> dict:
    """`malloc_steps` for each setting in fresh processes, A-B-B-A: per setting the median of its two
    processes' median step times, and its larger peak resident set."""
    runs: dict[str, list[dict]] = {name: [] for name in MALLOC_SETTINGS}
    for setting in (*MALLOC_SETTINGS, *reversed(MALLOC_SETTINGS)):
        out = subprocess.run([sys.executable, __file__, setting, str(steps), json.dumps(model)],
                             capture_output=True, text=True, env=env, check=True)
        runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {name: {"median_step_s": statistics.median(r["median_step_s"] for r in rows),
                   "peak_resident_bytes": max(r["peak_resident_bytes"] for r in rows),
                   "step_s_per_process": [r["median_step_s"] for r in rows]}
            for name, rows in runs.items()} | {"steps": steps}


def print_malloc(malloc: dict) -> None:
    glibc, fixed = (malloc[name] for name in MALLOC_SETTINGS)
    slower = fixed["median_step_s"] / glibc["median_step_s"] - 1
    print(f"malloc (each setting in fresh processes, A-B-B-A, {malloc['steps']} steps each): glibc's default, median "
          f"step {glibc['median_step_s']:.3f}s, peak resident {glibc['peak_resident_bytes'] / 2**20:.0f}M; mmap "
          f"threshold fixed at 64K {fixed['median_step_s']:.3f}s ({slower:+.1%}), peak resident "
          f"{fixed['peak_resident_bytes'] / 2**20:.0f}M")


if __name__ == "__main__":
    print(json.dumps(malloc_steps(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))))
