"""bench/lora_mfu.py's fusion side (`--side fusion`, one process): a fused step's tokens/s with 1..N adapters at equal
total tokens (32 sequences a step: 4,096 tokens on a GPU), each count's as a ratio to the fewest's (median step). The
fewest and the most adapters run first, the counts between after: a part cut at its limit keeps both ends.

With --profile DIR, two steps of the fewest adapters and two of the most run under torch.profiler after their timed
ones (DIR/adapters-<n>/: bench/profile_step.py; the Chrome trace of the most's only), and the result's
`profile_growth` says where the step's time grew between the two: the kernels whose time a step grew most, and the
step's kernel and busy time, kernels and launches at each end (the 2026-12-04 lease measured 0.733 at 32 adapters
where the cost model said 0.911: this is what says why)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from lora_bench import (
    LORA,
    SHAPES,
    ListSource,
    StepClock,
    allocator_events,
    allocator_events_since,
    compute_dtype,
    engine_settings,
    log,
    memory_fields,
    random_model,
    step_summary,
    sync,
    write,
)


def fusion_side(args: argparse.Namespace, device: torch.device) -> dict:
    """A fused step's tokens/s with N adapters at equal total tokens, as a ratio to the fewest (median step)."""
    from actors.data import Example
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from actors.engine.warmup import settle_garbage_collector, warm_up
    from actors.spec.job_spec import JobSpec
    base = from_module(random_model(args.shape, device, compute_dtype(device)), None)
    warm_up(base, 1 << 17)   # as the service's trainer does at start-up
    settle_garbage_collector()   # as aspen's trainer does once set up (actors/engine/warmup.py)
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = random.Random(0)
    sequences, length = 32, 128 if device.type == "cuda" else 32   # 4096 tokens a step on a GPU
    result: dict = {"sequences": sequences, "length": length, "per_adapters": {}, "efficiency": {}}
    counts = [int(n) for n in args.adapters.split(",")]
    profiled_counts = (min(counts), max(counts)) if args.profile and len(counts) > 1 else ()
    profiles: dict[int, dict] = {}
    for adapters in _in_order_of_what_they_tell(counts):
        trainer = FusedTrainer(base, step_tokens=1 << 17)
        profiled = 2 if adapters in profiled_counts else 0
        per_job, total = sequences // adapters, args.warmup + args.steps + profiled
        for job in range(adapters):
            batches = []
            for _ in range(total):
                batch = []
                for _ in range(per_job):
                    ids = tuple(rng.randrange(3, vocab) for _ in range(length))
                    batch.append(Example(ids, ids))
                batches.append(batch)
            spec = JobSpec(name=f"f{adapters}-{job}", data="unused.jsonl", format={"type": "text"},
                           batch_size=per_job, max_steps=total, lr=1e-4, lora=LORA)
            trainer.add_job(TrainingJob.attach(spec, base, ListSource(batches), [], total, seed=job))
        for _ in range(args.warmup):
            trainer.train_step()
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        events = allocator_events(device)
        clock = StepClock(device)
        clock.mark()
        for _ in range(args.steps):
            trainer.train_step()
            clock.mark()
        summary = step_summary(clock.seconds(), [sequences * length] * args.steps)
        summary["tokens_per_s_at_median"] = sequences * length / summary["median_step_s"]
        summary.update(allocator_events_since(device, events))
        summary.update(memory_fields(device))
        summary["engine_defaults"] = engine_settings(trainer)
        result["per_adapters"] = _by_count({**result["per_adapters"], str(adapters): summary})
        first = result["per_adapters"][str(min(counts))]["tokens_per_s_at_median"]
        result["efficiency"] = _by_count({**result["efficiency"],
                                          str(adapters): summary["tokens_per_s_at_median"] / first})
        log(f"[fusion] {adapters} adapters: median step {summary['median_step_s']:.3f}s, "
            f"efficiency {result['efficiency'][str(adapters)]:.3f}")
        if profiled:
            write(args, result)   # the figures first: a profile cut by the part's limit leaves them
            profiles[adapters] = _profile(args, trainer, device, adapters, summary["median_step_s"],
                                          trace=adapters == max(counts))
            result["profile"] = {"adapters": adapters, **profiles[adapters]}   # the most's, last
            if len(profiles) == 2:
                from profile_step import growth
                fewest, most = profiled_counts
                result["profile_growth"] = {"adapters": [fewest, most], **growth(profiles[fewest], profiles[most])}
        for name in list(trainer.jobs):
            trainer.remove_job(name)
        write(args, result)
    return result


def _in_order_of_what_they_tell(counts: list[int]) -> list[int]:
    """The fewest adapters first (every efficiency is a ratio to it), then the most (the goal at 32, and the two
    profiles whose difference says where the step's time grew), then the others from the fewest up: a part cut
    at its limit (fusion8b, ~100 s of its 120 on an H200 before the profiles) loses the counts between."""
    ends = [min(counts), max(counts)] if len(counts) > 1 else counts[:1]
    return ends + sorted(n for n in counts if n not in ends)


def _by_count(figures: dict[str, object]) -> dict[str, object]:
    return dict(sorted(figures.items(), key=lambda item: int(item[0])))


def _profile(args: argparse.Namespace, trainer, device: torch.device, adapters: int, median_step_s: float,
             trace: bool) -> dict:
    from profile_step import profile_steps
    return profile_steps(trainer.train_step, device, 2, Path(args.profile) / f"adapters-{adapters}",
                         median_step_s=median_step_s, trace=trace)
