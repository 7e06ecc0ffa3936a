#!/usr/bin/env python
"""Submit latency as the job table grows: p95 of single-job submissions (client -> scheduler actor ->
validated, written to SQLite -> answer) with 10 jobs in the table and with 2000, side by side in one run,
through a real service (Ray, the scheduler actor, its scheduling loop at its default tick, a trainer).
Goal: p95 at 2000 jobs / p95 at 10 jobs <= 2.

Three tables are measured, each from a fresh service:
- `waiting`: the trainer (max_jobs 1) trains one long job, and every other job waits for it: they are for
  its base model, so each scheduling round the policy weighs all of them against the trainer's memory and
  slots: the scheduler's hot path at its busiest;
- `unheld`: every job waits for a base model no trainer holds (each round still sees them all);
- `finished`: the jobs were submitted and cancelled, so the table is mostly history.

    .venv/bin/python bench/submit_latency.py [--jobs 2000] [--samples 100] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import deep_tiny_model
import ray

from actors.service.scheduler.config import EventsConfig, MetricsConfig, ServiceConfig, TrainerConfig
from orchestrator.client import Client

UNHELD_BASE = "bench-base-no-trainer-holds"   # jobs for it wait in the queue with a reason
FILL_BATCH = 200


def log(message: str) -> None:
    print(message, flush=True)


def job(name: str, data: Path) -> dict:
    return {"name": name, "data": str(data), "batch_size": 4, "max_seq_len": 128, "max_steps": 100, "lr": 1e-3,
            "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def base_for(kind: str, base: Path) -> str:
    return str(base) if kind == "waiting" else UNHELD_BASE


def measure(client: Client, data: Path, samples: int, label: str, base_model: str) -> list[float]:
    """Seconds per single-job submission, `samples` of them one after another (each answered before the
    next is sent), the way a user's loop or `aspen submit` submits."""
    seconds = []
    for index in range(samples):
        started = time.perf_counter()
        client.submit(job(f"{label}-{index}", data), base_model=base_model)
        seconds.append(time.perf_counter() - started)
    return seconds


def fill(client: Client, data: Path, count: int, finished: bool, prefix: str, base_model: str) -> None:
    """Add `count` jobs in batches; with `finished`, cancel them (queued -> cancelled) as they come."""
    for start in range(0, count, FILL_BATCH):
        handles = client.submit_many([job(f"{prefix}-{start + i}", data) for i in range(min(FILL_BATCH,
                                                                                            count - start))],
                                     base_model=base_model)
        if finished:
            for handle in handles:
                handle.cancel()


def run_table(kind: str, base: Path, data: Path, jobs: int, samples: int, work: Path) -> dict:
    config = ServiceConfig(state_dir=work / f"state-{kind}",
                           trainers=[TrainerConfig(base_model=str(base), step_tokens=512, threads=1, num_cpus=0.5,
                                                   max_jobs=1)],
                           metrics=MetricsConfig(port=0), events=EventsConfig(embedded_port=0))
    client = Client.local(config)
    base_model = base_for(kind, base)
    try:
        if kind == "waiting":   # the one job the trainer trains while the others wait
            long_job = client.submit({**job("long", data), "max_steps": 10**6}, base_model=base_model)
            deadline = time.time() + 120
            while long_job.status().step < 1:
                assert time.time() < deadline, long_job.status()
                time.sleep(0.5)
        measure(client, data, 5, "warmup", base_model)   # the first calls pay for imports and connections
        fill(client, data, 10 - len(client.jobs()), kind == "finished", "small", base_model)
        small_table = len(client.jobs())
        small = measure(client, data, samples, "small", base_model)
        fill(client, data, jobs - len(client.jobs()), kind == "finished", "large", base_model)
        time.sleep(2)   # a few scheduling rounds over the full table
        large_table = len(client.jobs())
        large = measure(client, data, samples, "large", base_model)
    finally:
        client.shutdown()
    result = {"table": kind, "jobs_small": small_table, "jobs_large": large_table, "samples": samples,
              "p50_small_ms": 1000 * statistics.median(small), "p95_small_ms": 1000 * percentile(small, 0.95),
              "p50_large_ms": 1000 * statistics.median(large), "p95_large_ms": 1000 * percentile(large, 0.95)}
    result["p95_ratio"] = result["p95_large_ms"] / result["p95_small_ms"]
    log(f"{kind:>8} table: p95 {result['p95_small_ms']:.1f} ms at {small_table} jobs, "
        f"{result['p95_large_ms']:.1f} ms at {large_table} jobs -> ratio {result['p95_ratio']:.2f} "
        f"(p50 {result['p50_small_ms']:.1f} / {result['p50_large_ms']:.1f} ms)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs in the large table")
    parser.add_argument("--samples", type=int, default=100, help="submissions timed per table size")
    parser.add_argument("--tables", default="waiting,unheld,finished")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "base"
        deep_tiny_model.main([str(base)])
        data = work / "data.jsonl"
        data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(16)))
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20)
        try:
            results = [run_table(kind, base, data, args.jobs, args.samples, work) for kind in args.tables.split(",")]
        finally:
            ray.shutdown()
    worst = max(r["p95_ratio"] for r in results)
    log(f"submit latency p95 ratio ({args.jobs} jobs vs 10): {worst:.2f} (goal <= 2) -> "
        f"{'met' if worst <= 2 else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "worst_p95_ratio": worst}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
