"""Check the scheduling simulator (`orchestrator.simulator.simulate`) against a real run: the service trains jobs that
arrive one after another on the real base model; the simulator, calibrated from that run's step log and
job table, replays the same arrivals, sizes and sequence lengths with the same policy; the two makespans
are printed side by side (goal: the prediction within 15% of the measurement). It also prints how far the
trainer's online memory model was off each real step's measured peak (goal: 3% on average).

    python bench/simulator_check.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.service.scheduler.config import EventsConfig, MetricsConfig, run_service_config
from bench.overhead import require_completed
from orchestrator.demo import TASKS, TRAIN_ROWS, TRAIN_SEED, build_spec, make_rows, write_jsonl
from orchestrator.simulator.sim_calibration import calibrate
from orchestrator.simulator.sim_replay import Simulator
from orchestrator.simulator.sim_trace import Lengths, Trace, TraceJob, TrainerSpec
from policies.registry import load_policy

GOAL = 0.15


def log(message: str) -> None:
    print(message, flush=True)


def real_run(work: Path, steps: list[int], gaps: float, policy: str) -> dict:
    from orchestrator.client import Client

    data = {task.name: write_jsonl(work / "data" / f"{task.name}.jsonl", make_rows(task, TRAIN_ROWS, TRAIN_SEED))
            for task in TASKS}
    spec = build_spec(work / "out", data, max(steps))
    jobs = [job.model_copy(update={"max_steps": n, "warmup_steps": min(job.warmup_steps, n - 1)})
            for job, n in zip(spec.jobs, steps, strict=True)]
    spec = spec.model_copy(update={"jobs": jobs, "policy": policy})
    state = work / "state"
    config = run_service_config(spec, state_dir=state, metrics=MetricsConfig(enabled=False),
                                events=EventsConfig(enabled=False))
    client = Client.local(config)
    try:
        handles = []
        started = time.time()
        for index, submission in enumerate(spec.submissions()):
            time.sleep(max(started + index * gaps - time.time(), 0))
            handles.append(client.submit(submission))
            log(f"  submitted {submission.job.name} ({submission.job.max_steps} steps) at {time.time() - started:.1f}s")
        records = client.wait_all([h.id for h in handles], timeout=3600, poll=1.0)
        trainer_info = client.trainers()[0]
    finally:
        client.shutdown()
    require_completed(records)
    return {"spec": spec, "records": records, "state": state, "trainer": trainer_info}


def step_rows(state: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((state / "trainers").glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def memory_errors(rows: list[dict]) -> list[float]:
    """(predicted − measured) / measured peak memory of every step that has both (> 0: overestimated)."""
    return [(r["predicted_memory_bytes"] - r["peak_memory_bytes"]) / r["peak_memory_bytes"]
            for r in rows if r.get("predicted_memory_bytes") and r.get("peak_memory_bytes")]


def trace_of(run: dict) -> Trace:
    """The real run as a trace: arrivals, sizes and each job's measured sequence lengths."""
    rows = step_rows(run["state"])
    records = {r.id: r for r in run["records"]}
    specs = {job.name: job for job in run["spec"].jobs}
    lengths: dict[str, list[int]] = {job_id: [] for job_id in records}
    for row in rows:   # a step's sequences are grouped by job in the order of its job list
        position = 0
        for job_id in row["jobs"]:
            count = specs[records[job_id].name].batch_size
            lengths[job_id] += row["sequence_lengths"][position:position + count]
            position += count
    first = min(r.submitted_at for r in records.values())
    jobs = []
    for job_id, record in records.items():
        spec = specs[record.name]
        seen = lengths[job_id]
        jobs.append(TraceJob(name=record.name, arrival=record.submitted_at - first, steps=record.step,
                             batch_size=spec.batch_size, grad_accum=spec.grad_accum, rank=spec.lora.r,
                             lengths=Lengths(mean=statistics.fmean(seen), std=statistics.pstdev(seen),
                                             min=min(seen), max=max(seen))))
    spec = run["spec"]   # every job has the same LoRA config: a step with one job on the trainer tells its size
    one_job = min((r["adapter_parameters"] for r in rows if len(r["jobs"]) == 1 and r.get("adapter_parameters")),
                  default=57_600 * spec.jobs[0].lora.r)
    per_rank = one_job // spec.jobs[0].lora.r
    trainer = TrainerSpec(memory_budget_bytes=run["trainer"]["memory_budget_bytes"], step_tokens=spec.step_tokens,
                          layout=spec.layout)
    return Trace(name="real-run", trainers=[trainer], parameters_per_rank=per_rank,
                 calibration=calibrate(run["state"]), jobs=jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter jobs (about 2 min on 2 CPU cores)")
    parser.add_argument("--policy", default="adaptive")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = [6, 3, 5, 4] if args.quick else [24, 8, 16, 12]
    gaps = 10.0 if args.quick else 30.0
    with tempfile.TemporaryDirectory(prefix="aspen-simcheck-") as folder:
        log(f"real run: {len(steps)} jobs ({steps} steps) arriving {gaps:.0f}s apart, policy {args.policy}")
        run = real_run(Path(folder), steps, gaps, args.policy)
        records = run["records"]
        measured = max(r.finished_at for r in records) - min(r.submitted_at for r in records)
        trace = trace_of(run)
        errors = memory_errors(step_rows(run["state"]))
    result = Simulator(trace, load_policy(args.policy)).run()
    predicted = result.makespan
    error = (predicted - measured) / measured
    c = trace.calibration
    log(f"calibration: step ≈ {c.step.constant:.3f} s + {c.step.per_token * 1000:.3f} ms/token + "
        f"{c.step.per_square * 1e6:.4f} µs/token²; job start {c.job_start_seconds:.1f} s")
    log(f"{'':<28}{'measured':>10}{'simulated':>11}")
    log(f"{'makespan':<28}{measured:>9.1f}s{predicted:>10.1f}s")
    for record in sorted(records, key=lambda r: r.submitted_at):
        log(f"{'turnaround ' + record.name:<28}{record.finished_at - record.submitted_at:>9.1f}s"
            f"{result.turnaround[[j.name for j in trace.jobs].index(record.name)]:>10.1f}s")
    verdict = "met" if abs(error) <= GOAL else "NOT met"
    log(f"simulated makespan {error:+.1%} off the measured one (goal within ±{GOAL:.0%}): {verdict}")
    if errors:
        size = [abs(e) for e in errors]
        log(f"memory model: predicted peak off the measured one by {statistics.fmean(size):.2%} on average over "
            f"{len(size)} steps ({statistics.fmean(size[5:] or size):.2%} after the first 5 steps; first step, "
            f"before any measurement: {errors[0]:+.1%}; worst after it: {max(size[1:] or size):.2%}; "
            f"goal ≤ 3% on average): {'met' if statistics.fmean(size) <= 0.03 else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"measured_makespan_s": measured, "simulated_makespan_s": predicted,
                                         "relative_error": error, "memory_errors": errors,
                                         "calibration": c.model_dump(),
                                         "trace": trace.model_dump(mode="json")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
