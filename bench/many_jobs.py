#!/usr/bin/env python
"""Hundreds of small jobs from one file, all to the end, on this machine: the service admits only as many
running jobs as each node's memory holds job actors for (ServiceConfig.job_slots: each running job's actor is
a process of ~200 MB), and the rest wait queued without a process.

Before that limit, 300 one-step jobs from one file were all admitted as running at once, their job actors
started one after another, and the machine's available memory fell from ~14 GB to 2.9 GB after 216 s with 9
jobs done (issue 34). Printed: wall time, jobs per hour, the peak of the machine's used memory over its
level before the service started and of the service's processes' resident memory (all `ray::` processes),
the most job actors alive at once, and each job's start latency (its `running` transition to its first
optimizer step: the job actor's start, its data, its first step), median and p95.

    .venv/bin/python bench/many_jobs.py [--jobs 300] [--steps 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import deep_tiny_model
import psutil

from actors.service.scheduler.config import run_service_config
from orchestrator.client import Client
from orchestrator.jobs_file import load_run_spec


class MemorySampler:
    """Every 0.5 s: the machine's used memory (total - available) and the `ray::` processes' resident sum."""

    def __init__(self):
        self.used_before = psutil.virtual_memory().total - psutil.virtual_memory().available
        self.peak_used = self.peak_ray = self.most_job_actors = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopping.is_set():
            memory = psutil.virtual_memory()
            self.peak_used = max(self.peak_used, memory.total - memory.available)
            ray_rss, job_actors = 0, 0
            for process in psutil.process_iter(["cmdline", "memory_info"]):
                command = " ".join(process.info["cmdline"] or [])
                if command.startswith("ray::") and process.info["memory_info"] is not None:
                    ray_rss += process.info["memory_info"].rss
                    job_actors += command.startswith("ray::JobActor")
            self.peak_ray = max(self.peak_ray, ray_rss)
            self.most_job_actors = max(self.most_job_actors, job_actors)
            self.stopping.wait(0.5)

    def __enter__(self) -> MemorySampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()


def write_jobs(folder: Path, base: Path, jobs: int, steps: int) -> Path:
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(64)))
    job = {"data": "data.jsonl", "batch_size": 4, "max_seq_len": 64, "max_steps": steps, "lr": 1e-3,
           "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
           "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}, "checkpoint_every": 1000}
    path = folder / "jobs.yaml"
    path.write_text(json.dumps({"base_model": str(base), "output_dir": "out", "step_tokens": 2048,
                                "jobs": [{**job, "name": f"small-{i}"} for i in range(jobs)]}))
    return path


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base = folder / "model"
        deep_tiny_model.main([str(base)])
        spec = load_run_spec(write_jobs(folder, base, args.jobs, args.steps))
        config = run_service_config(spec, state_dir=folder / "state")
        with MemorySampler() as sampler:
            started = time.time()
            client = Client.local(config)
            try:
                handles = client.submit_run(spec)
                slots = client.info().get("job_slots")
                records = client.wait_all([h.id for h in handles], timeout=24 * 3600)
                wall = time.time() - started
                _, history = client.transitions_after(0, 100 * args.jobs)
                first_step = {}
                for record in records:
                    rows = client.losses(record.id)
                    if rows:
                        first_step[record.id] = rows[0]["time"]
            finally:
                client.shutdown()
    ran = {}
    for row in history:
        if row["state"] == "running":
            ran.setdefault(row["job"], row["time"])
    latency = [first_step[job] - at for job, at in ran.items() if job in first_step]
    done = sum(r.state == "completed" for r in records)
    result = {"jobs": args.jobs, "steps": args.steps, "completed": done, "wall_s": round(wall, 1),
              "jobs_per_hour": round(done / wall * 3600), "job_slots": slots,
              "peak_used_over_start_bytes": sampler.peak_used - sampler.used_before,
              "peak_ray_processes_rss_bytes": sampler.peak_ray, "most_job_actors_alive": sampler.most_job_actors,
              "start_latency_median_s": round(statistics.median(latency), 2) if latency else None,
              "start_latency_p95_s": round(percentile(latency, 0.95), 2) if latency else None}
    print(f"{done}/{args.jobs} jobs completed in {wall:.0f} s ({result['jobs_per_hour']} jobs/hour); "
          f"peak memory: machine +{result['peak_used_over_start_bytes'] / 2**30:.2f} GiB over its start, ray "
          f"processes {sampler.peak_ray / 2**30:.2f} GiB resident, at most {sampler.most_job_actors} job actors "
          f"alive; start latency median {result['start_latency_median_s']} s, p95 {result['start_latency_p95_s']} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if done == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
