"""Overhead of the actor system: the same jobs trained by the in-process engine and through the service
(scheduler, trainer actor, a job actor per job streaming micro-batches), tokens/s side by side from one
run. Goal: actor system / in-process >= 0.95.

Both sides get the model loaded and warmed up (one throwaway step, `actors/engine/warmup.py`, as the
service's trainer does at start-up) before the clock starts; the in-process side is `train_locally` (steps,
adapters written), the service side is submit -> every job completed (job actors start and tokenize,
micro-batches stream, checkpoints and adapters are written, the scheduler polls). Tokens are the jobs'
real tokens, counted from the runs' own step logs.

A third side splits the gap in two: the in-process engine again, beside an idle Ray started as the service
starts it (`ensure_ray`: Ray's daemons and its prestarted workers, no actors). Engine beside Ray / engine
is what Ray's mere presence costs on this machine; actor system / engine beside Ray is what the actor
system adds on top. Each side starts with no Ray running (and stops the Ray it started), so no side runs
beside another side's leftovers.

This machine's speed drifts (on the 2-core CI-class VM the engine alone ran 249-286 tokens/s within 8
minutes), so `--rounds N` repeats the A-B-C-C-B-A pattern N times and prints each round's ratio beside the
overall one: the spread says how far one round's ratio can be trusted.

    python bench/overhead.py [--quick] [--steps N] [--rounds N] [--threads N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.engine.models import load_base_model, load_base_tokenizer
from actors.engine.warmup import settle_garbage_collector, warm_up
from actors.service.scheduler.config import run_service_config
from actors.service.scheduler.local_run import train_locally
from actors.spec.run_spec import RunSpec
from orchestrator.demo import TASKS, TRAIN_ROWS, TRAIN_SEED, build_spec, make_rows, write_jsonl


def log(message: str) -> None:
    print(message, flush=True)


def step_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_in_process(spec: RunSpec, base, label: str = "in-process engine") -> dict:
    ends: list[float] = []
    started = time.perf_counter()
    train_locally(spec, base=base, progress=False, on_step=lambda report: ends.append(time.time()))
    seconds = time.perf_counter() - started
    rows = step_rows(Path(spec.output_dir) / "trainer.jsonl")
    for row, end in zip(rows, ends, strict=False):   # a step log row may outnumber the callbacks seen
        row["time"] = end
    return summarize(label, rows, seconds)


def run_beside_ray(spec: RunSpec, base) -> dict:
    """The in-process engine while an idle Ray runs on the machine, started as `Client.local` starts it."""
    from orchestrator.ray_cluster import ensure_ray

    ensure_ray()
    try:
        return run_in_process(spec, base, label="engine beside Ray")
    finally:
        ray.shutdown()


def run_through_service(spec: RunSpec, state_dir: Path, threads: int | None = None) -> dict:
    """`threads`: the trainer's torch threads (default: the service's own choice, the node's cores)."""
    from orchestrator.client import Client

    # the trainer runs where the in-process engine ran: on the GPU when there is one (a TrainerActor)
    config = run_service_config(spec, state_dir=state_dir, trainer={"threads": threads})
    client = Client.local(config)   # waits for the model
    try:
        started = time.perf_counter()
        handles = client.submit_run(spec)
        records = client.wait_all([h.id for h in handles], timeout=3600, poll=2.0)
        seconds = time.perf_counter() - started
        trainer_info = client.trainers()[0]
    finally:
        client.shutdown()
        ray.shutdown()
    require_completed(records)
    rows = step_rows(Path(spec.output_dir) / "trainer.jsonl")
    result = summarize("actor system", rows, seconds)
    result["data_waits"] = trainer_info.get("data_waits", 0)
    return result


def require_completed(records) -> None:
    """A benchmark measures only runs whose every job completed."""
    bad = [r for r in records if r.state != "completed"]
    if bad:
        raise RuntimeError(f"jobs did not complete: {[(r.name, r.state, r.reason) for r in bad]}")


def summarize(label: str, rows: list[dict], seconds: float) -> dict:
    """Three views of throughput: training (first step's start to last step's end: everything between
    steps counts, waits for data and scheduling included), inside the steps, and end to end (job start-up:
    job actors starting, tokenizing, and the final writes included)."""
    tokens = sum(r["tokens"] - r["padding_tokens"] for r in rows)
    compute = sum(r["seconds"] for r in rows)
    training = rows[-1]["time"] - (rows[0]["time"] - rows[0]["seconds"])
    result = {"label": label, "steps": len(rows), "tokens": tokens, "wall_seconds": seconds,
              "training_seconds": training, "compute_seconds": compute,
              "tokens_per_s": tokens / training, "end_to_end_tokens_per_s": tokens / seconds,
              "compute_tokens_per_s": tokens / compute, "step_seconds": [r["seconds"] for r in rows]}
    log(f"  {label:<18} {len(rows)} fused steps, {tokens} tokens: {training:.1f}s from first step to last "
        f"({compute:.1f}s inside steps), {seconds:.1f}s end to end")
    return result


def merge(runs: list[dict]) -> dict:
    """Several runs of one side as one: tokens and seconds summed."""
    tokens = sum(r["tokens"] for r in runs)
    merged = {key: sum(r[key] for r in runs) for key in ("wall_seconds", "training_seconds", "compute_seconds")}
    merged.update(tokens=tokens, tokens_per_s=tokens / merged["training_seconds"],
                  end_to_end_tokens_per_s=tokens / merged["wall_seconds"],
                  compute_tokens_per_s=tokens / merged["compute_seconds"],
                  step_seconds=[t for r in runs for t in r["step_seconds"]],
                  data_waits=sum(r.get("data_waits", 0) for r in runs))
    return merged


def round_ratios(results: dict[str, list[dict]], rounds: int) -> list[tuple[float, float]]:
    """Per round of the pattern: (actor system / in-process, engine beside idle Ray / engine alone)."""
    out = []
    for number in range(rounds):
        merged = {side: merge(runs[number * len(runs) // rounds:(number + 1) * len(runs) // rounds])
                  for side, runs in results.items()}
        out.append((merged["service"]["tokens_per_s"] / merged["engine"]["tokens_per_s"],
                    merged["beside_ray"]["tokens_per_s"] / merged["engine"]["tokens_per_s"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run, not a measurement)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 30, quick 4)")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, the same on every side (default: torch's own, the machine's cores); "
                             "fewer than the cores leaves the rest to the service's other processes")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the A-B-C-C-B-A pattern this many times (per-round ratios show the spread)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (4 if args.quick else 30)
    work = Path(tempfile.mkdtemp(prefix="aspen-overhead-"))
    data = {task.name: write_jsonl(work / "data" / f"{task.name}.jsonl", make_rows(task, TRAIN_ROWS, TRAIN_SEED))
            for task in TASKS}
    load_base_tokenizer(args.base_model, work / "state" / "cache")   # both sides start with a warm tokenizer
    log(f"overhead: {len(TASKS)} jobs x {steps} steps on {args.base_model}; {os.cpu_count()} CPUs; work in {work}")

    spec = build_spec(work / "in-process", data, steps).model_copy(update={"base_model": args.base_model})
    base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device)
    warm_up(base, spec.step_tokens)   # as the service's trainer does at start-up: both sides start warm, and
    settle_garbage_collector()         # with the collector's start-up objects frozen (actors/engine/warmup.py)
    device_name = torch.cuda.get_device_name(base.device) if base.device.type == "cuda" else "CPU"
    log(f"device: {device_name} ({base.device}), {base.dtype}, {torch.get_num_threads()} torch threads")
    # A-B-C-C-B-A: a slow spell of the machine or a warm-up drift hits every side alike.
    sides = ["engine", "beside_ray", "service"]
    order = (sides if args.quick else sides + sides[::-1]) * args.rounds
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for index, side in enumerate(order):
        run = spec.model_copy(update={"output_dir": work / f"{index}-{side}"})
        if side == "engine":
            results[side].append(run_in_process(run, base))
        elif side == "beside_ray":
            results[side].append(run_beside_ray(run, base))
        else:
            results[side].append(run_through_service(run, work / f"state-{index}", args.threads))
    engine, beside_ray, service = (merge(results[side]) for side in sides)
    ratio = service["tokens_per_s"] / engine["tokens_per_s"]
    ray_cost = beside_ray["tokens_per_s"] / engine["tokens_per_s"]
    own_ratio = service["tokens_per_s"] / beside_ray["tokens_per_s"]
    compute_ratio = service["compute_tokens_per_s"] / engine["compute_tokens_per_s"]
    end_to_end_ratio = service["end_to_end_tokens_per_s"] / engine["end_to_end_tokens_per_s"]
    step_ratio = statistics.median(engine["step_seconds"]) / statistics.median(service["step_seconds"])
    log("")
    runs = len(results["engine"])
    log(f"{'measurement (' + str(runs) + (' runs each, A-B-C-C-B-A)' if runs > 1 else ' run each)'):<56}"
        f"{'value':>10}  goal")
    log(f"{'in-process engine, training tok/s':<56}{engine['tokens_per_s']:>10.0f}")
    log(f"{'in-process engine beside an idle Ray, training tok/s':<56}{beside_ray['tokens_per_s']:>10.0f}")
    log(f"{'actor system, training tok/s':<56}{service['tokens_per_s']:>10.0f}")
    log(f"{'actor system / in-process, training tok/s':<56}{ratio:>10.3f}  >= 0.95  "
        f"{'met' if ratio >= 0.95 else 'NOT met'}")
    log(f"{'actor system / in-process, inside fused steps':<56}{compute_ratio:>10.3f}")
    log(f"{'actor system / in-process, median step':<56}{step_ratio:>10.3f}")
    log(f"{'actor system / in-process, end to end (with job start-up)':<56}{end_to_end_ratio:>10.3f}")
    log(f"{'the gap in two: engine beside idle Ray / engine alone':<56}{ray_cost:>10.3f}")
    log(f"{'           and: actor system / engine beside idle Ray':<56}{own_ratio:>10.3f}")
    log(f"{'steps that waited for data (actor system)':<56}{service['data_waits']:>10}")
    per_round = round_ratios(results, args.rounds)
    if len(per_round) > 1:
        log("")
        for number, (round_ratio, round_ray_cost) in enumerate(per_round, 1):
            log(f"round {number}: actor system / in-process {round_ratio:.3f}, engine beside idle Ray / engine "
                f"alone {round_ray_cost:.3f}")
        ratios = [r for r, _ in per_round]
        log(f"actor system / in-process over {len(ratios)} rounds: median {statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f}")
    if args.json:
        args.json.write_text(json.dumps({"steps_per_job": steps, "torch_threads": torch.get_num_threads(),
                                         "runs": results, "ratio": ratio,
                                         "round_ratios": [r for r, _ in per_round],
                                         "compute_ratio": compute_ratio, "median_step_ratio": step_ratio,
                                         "end_to_end_ratio": end_to_end_ratio,
                                         "beside_ray_ratio": ray_cost, "service_vs_beside_ray_ratio": own_ratio},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
