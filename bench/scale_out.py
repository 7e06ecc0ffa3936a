#!/usr/bin/env python
"""Scale-out throughput: the same batch of short jobs through the real service (Ray, the scheduler actor,
trainer actors, a job actor per job) with 1, 2 and 4 CPU trainers on the same machine budget, side by side
from one run: jobs/hour, effective tokens/s (real tokens, padding excluded) and each trainer's utilisation.

Every service gets the same Ray (`--cpus` CPUs, shared by its trainers: `num_cpus` = cpus / trainers) and
trainers of one torch thread each (`TrainerConfig(count=N, threads=1)`), a tiny random model
(`bench/deep_tiny_model.py`: SmolLM2-135M's 30 layers at width 64), and the default policy; the jobs are
submitted together once every trainer is ready (trainer start-up is not timed).

- jobs/hour: jobs / (first submission -> last job completed): job start-up (job actors starting and
  tokenizing), every step and the final writes included;
- effective tokens/s: the jobs' real tokens over the same wall time, and over the training window (the
  first step's start to the last step's end, over all trainers);
- utilisation of a trainer, two ways: "min util", its time inside fused steps / the training window (first
  step anywhere to last step anywhere: strict, a trainer whose jobs ended first counts as idle until the
  last trainer's end); "min busy", the goal's own terms (>= 90%: no trainer idles while jobs wait): its
  time inside fused steps / the time in which it held jobs or jobs waited for a trainer (first step
  anywhere to the later of its own last step and the last job's start). A trainer's step log
  (`<state>/trainers/<id>.jsonl`) has each step's end time and seconds. Beside them, as a diagnostic,
  "steady": the window share from each trainer's fourth step on.

On a machine with fewer cores than trainers the trainers share cores: the numbers then say what the
placement does (every trainer busy), not how throughput scales with hardware.

    .venv/bin/python bench/scale_out.py [--quick] [--trainers 1,2,4] [--jobs 8] [--steps N] [--json FILE] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import deep_tiny_model
import ray

from actors.service.scheduler.config import EventsConfig, MetricsConfig, ServiceConfig, TrainerConfig
from orchestrator.client import Client
from orchestrator.ray_cluster import ensure_ray

GOAL_UTILISATION = 0.90
STEADY_FROM = 3   # steps of each trainer left out of the steady utilisation (a diagnostic)


def log(message: str) -> None:
    print(message, flush=True)


def job(name: str, data: Path, steps: int, seq_len: int) -> dict:
    return {"name": name, "data": str(data), "batch_size": 4, "max_seq_len": seq_len, "max_steps": steps,
            "lr": 1e-3, "checkpoint_every": 1000,
            "format": {"type": "prompt_response", "prompt": "Q: {question}\nA:", "response": " {answer}"},
            "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}


def write_data(folder: Path, jobs: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(jobs):
        path = folder / f"task{index}.jsonl"
        path.write_text("".join(json.dumps({"question": f"task {index}: what is {i} plus {3 * i + index}?",
                                            "answer": f"{4 * i + index}, task {index}"}) + "\n" for i in range(64)))
        paths.append(path)
    return paths


def step_rows(state: Path) -> dict[str, list[dict]]:
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            for path in sorted((state / "trainers").glob("*.jsonl"))}


def run(trainers: int, base: Path, data: list[Path], steps: int, seq_len: int, cpus: float, step_tokens: int,
        work: Path) -> dict:
    state = work / f"state-{trainers}"
    config = ServiceConfig(state_dir=state, tick_seconds=0.1,
                           trainers=[TrainerConfig(base_model=str(base), count=trainers, threads=1,
                                                   num_cpus=cpus / trainers, step_tokens=step_tokens)],
                           metrics=MetricsConfig(enabled=False), events=EventsConfig(enabled=False))
    log(f"{trainers} trainer(s): starting ...")
    started = time.time()
    client = Client.local(config)   # waits until every trainer has loaded its model
    try:
        ready = time.time()
        log(f"  ready after {ready - started:.1f}s; submitting {len(data)} jobs of {steps} steps")
        submitted = time.time()
        handles = client.submit_many([job(f"j{i}", path, steps, seq_len) for i, path in enumerate(data)],
                                     base_model=str(base))
        records = client.wait_all([h.id for h in handles], timeout=3600, poll=0.5)
        done = max(r.finished_at for r in records)
        data_waits = {t["id"]: t.get("data_waits", 0) for t in client.trainers()}
        placements, started_at = {}, {}
        for handle in handles:
            history = client.transitions(handle.id)
            trainers_seen = [reason.split(" on ", 1)[1].split()[0].rstrip(",")
                             for _, state_, reason in history
                             if state_ == "running" and reason.startswith("training on ")]
            placements[handle.id] = trainers_seen
            started_at[handle.id] = min(at for at, state_, _ in history if state_ == "running")
    finally:
        client.shutdown()
    bad = [(r.name, r.state, r.reason) for r in records if r.state != "completed"]
    if bad:
        raise RuntimeError(f"jobs did not complete with {trainers} trainer(s): {bad}")
    rows = {tid: [r for r in per if r["time"] >= submitted] for tid, per in step_rows(state).items()}
    all_rows = [r for per in rows.values() for r in per]
    first = min(r["time"] - r["seconds"] for r in all_rows)
    last = max(r["time"] for r in all_rows)
    window = last - first
    wall = done - submitted
    tokens = sum(r["tokens"] - r["padding_tokens"] for r in all_rows)
    utilisation = {tid: sum(r["seconds"] for r in per) / window for tid, per in rows.items()}
    # the goal's own terms: each trainer's stepping time over the time in which it held jobs or jobs waited
    # for a trainer (from the first step anywhere to the later of its own last step and the last job's start)
    queue_empty = max(started_at.values())
    while_waiting = {tid: sum(r["seconds"] for r in per) / (max(max(r["time"] for r in per), queue_empty) - first)
                     for tid, per in rows.items() if per}
    # a diagnostic beside it: from each trainer's STEADY_FROM-th step to the last step anywhere (the first
    # steps of a batch wait for the job actors' first answers, which a loaded machine makes slow)
    steady = {tid: sum(r["seconds"] for r in per[STEADY_FROM:]) / (last - (per[STEADY_FROM]["time"]
                                                                          - per[STEADY_FROM]["seconds"]))
              for tid, per in rows.items() if len(per) > STEADY_FROM}
    jobs_per_trainer = {tid: len({j for r in per for j in r["jobs"]}) for tid, per in rows.items()}
    moved = sum(len(set(t)) > 1 for t in placements.values())
    first_step = {tid: min(r["time"] - r["seconds"] for r in per) - submitted for tid, per in rows.items() if per}
    result = {"trainers": trainers, "jobs": len(records), "wall_s": wall, "training_window_s": window,
              "jobs_per_hour": 3600 * len(records) / wall, "tokens": tokens, "tokens_per_s": tokens / wall,
              "training_tokens_per_s": tokens / window, "utilisation": utilisation,
              "utilisation_while_work_waited": while_waiting,
              "steady_utilisation": steady, "jobs_per_trainer": jobs_per_trainer, "fused_steps": len(all_rows),
              "moved_jobs": moved,
              "trainer_start_s": ready - started, "first_step_after_s": first_step, "data_waits": data_waits,
              "mean_step_s": sum(r["seconds"] for r in all_rows) / len(all_rows)}
    log(f"  {len(records)} jobs in {wall:.1f}s ({window:.1f}s from first step to last), {tokens} tokens; "
        f"jobs per trainer {jobs_per_trainer}; moved jobs {moved}; utilisation "
        + ", ".join(f"{tid} {share:.0%}" for tid, share in utilisation.items())
        + "; while it held jobs or jobs waited: " + ", ".join(f"{tid} {share:.0%}" for tid,
                                                              share in while_waiting.items())
        + f" (from step {STEADY_FROM + 1} on: " + ", ".join(f"{tid} {share:.0%}" for tid, share in steady.items()) + ")"
        + f"; {len(all_rows)} fused steps of {result['mean_step_s']:.2f}s on average; first step "
        + ", ".join(f"{tid} {t:.1f}s" for tid, t in first_step.items()) + " after submission; data waits "
        + ", ".join(f"{tid} {n}" for tid, n in data_waits.items()))
    return result


def table(results: list[dict]) -> str:
    lines = [f"{'trainers':>8} {'jobs/h':>8} {'tokens/s':>9} {'train tok/s':>11} {'wall':>8} {'window':>8} "
             f"{'min util':>8} {'mean util':>9} {'min busy':>8} {'steady min':>10}  jobs per trainer"]
    for r in results:
        shares = list(r["utilisation"].values())
        lines.append(f"{r['trainers']:>8} {r['jobs_per_hour']:>8.0f} {r['tokens_per_s']:>9.0f} "
                     f"{r['training_tokens_per_s']:>11.0f} {r['wall_s']:>7.1f}s {r['training_window_s']:>7.1f}s "
                     f"{min(shares):>8.0%} {sum(shares) / len(shares):>9.0%} "
                     f"{min(r['utilisation_while_work_waited'].values()):>8.0%} "
                     f"{min(r['steady_utilisation'].values(), default=float('nan')):>10.0%}  "
                     + " ".join(str(n) for n in r["jobs_per_trainer"].values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short jobs: a few minutes on 2 CPU cores")
    parser.add_argument("--trainers", default="1,2,4", help="trainer counts to compare")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 60; quick 12)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--step-tokens", type=int, default=1024)
    parser.add_argument("--cpus", type=float, default=float(os.cpu_count() or 1),
                        help="the machine budget: Ray's CPUs, shared by the trainers (default: this machine's cores)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, default=None, help="keep the state folders (step logs, job tables) here")
    args = parser.parse_args(argv)
    steps = args.steps or (12 if args.quick else 60)
    counts = [int(n) for n in args.trainers.split(",")]
    with tempfile.TemporaryDirectory(prefix="aspen-scaleout-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = work / "base"
        deep_tiny_model.main([str(base)])
        data = write_data(work / "data", args.jobs)
        ensure_ray(num_cpus=args.cpus)
        try:
            results = [run(n, base, data, steps, args.seq_len, args.cpus, args.step_tokens, work) for n in counts]
        finally:
            ray.shutdown()
    log(f"\n{args.jobs} jobs x {steps} steps (batch 4, max_seq_len {args.seq_len}), {args.cpus:g} CPUs "
        f"({os.cpu_count()} cores here), 1 torch thread per trainer:")
    log(table(results))
    for key, name in (("utilisation_while_work_waited", "while it held jobs or jobs waited (min busy)"),
                      ("utilisation", "over the whole training window (min util)")):
        worst = min(min(r[key].values()) for r in results)
        log(f"lowest trainer utilisation {name}: {worst:.0%} (goal >= {GOAL_UTILISATION:.0%}): "
            f"{'met' if worst >= GOAL_UTILISATION else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"steps": steps, "cpus": args.cpus, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
