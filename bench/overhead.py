"""Overhead of the actor system: the same jobs trained by the in-process engine and through the service
(scheduler, trainer actor, a job actor per job streaming micro-batches), tokens/s side by side from one
run. Goal: actor system / in-process >= 0.95.

Both sides get the model loaded before the clock starts; the in-process side is `train_locally` (steps,
adapters written), the service side is submit -> every job completed (job actors start and tokenize,
micro-batches stream, checkpoints and adapters are written, the scheduler polls). Tokens are the jobs'
real tokens, counted from the runs' own step logs.

    python bench/overhead.py [--quick] [--steps N] [--json FILE]
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

from actors.core.config import ServiceConfig, TrainerConfig  # noqa: E402
from actors.engine.local_run import train_locally  # noqa: E402
from actors.engine.models import load_base_model, load_base_tokenizer  # noqa: E402
from actors.engine.spec import RunSpec  # noqa: E402
from orchestrator.demo import TASKS, TRAIN_ROWS, TRAIN_SEED, build_spec, make_rows, write_jsonl  # noqa: E402


def log(message: str) -> None:
    print(message, flush=True)


def step_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_in_process(spec: RunSpec, base) -> dict:
    started = time.perf_counter()
    train_locally(spec, base=base, progress=False)
    seconds = time.perf_counter() - started
    rows = step_rows(Path(spec.output_dir) / "trainer.jsonl")
    return summarize("in-process engine", rows, seconds)


def run_through_service(spec: RunSpec, state_dir: Path) -> dict:
    from orchestrator.client import Client

    trainer = TrainerConfig(base_model=spec.base_model, step_tokens=spec.step_tokens, layout=spec.layout,
                            step_log=Path(spec.output_dir) / "trainer.jsonl")
    client = Client.local(ServiceConfig(state_dir=state_dir, trainers=[trainer]))   # waits for the model
    try:
        started = time.perf_counter()
        handles = client.submit_run(spec)
        records = client.wait_all([h.id for h in handles], timeout=3600)
        seconds = time.perf_counter() - started
        trainer_info = client.trainers()[0]
    finally:
        client.shutdown()
    bad = [r for r in records if r.state != "completed"]
    if bad:
        raise RuntimeError(f"jobs did not complete: {[(r.name, r.state, r.reason) for r in bad]}")
    rows = step_rows(Path(spec.output_dir) / "trainer.jsonl")
    result = summarize("actor system", rows, seconds)
    result["data_waits"] = trainer_info.get("data_waits", 0)
    return result


def summarize(label: str, rows: list[dict], seconds: float) -> dict:
    tokens = sum(r["tokens"] - r["padding_tokens"] for r in rows)
    compute = sum(r["seconds"] for r in rows)
    result = {"label": label, "steps": len(rows), "tokens": tokens, "wall_seconds": seconds,
              "compute_seconds": compute, "tokens_per_s": tokens / seconds,
              "compute_tokens_per_s": tokens / compute}
    log(f"  {label:<18} {len(rows)} fused steps, {tokens} tokens in {seconds:.1f}s wall "
        f"({compute:.1f}s in steps): {result['tokens_per_s']:.0f} tok/s end to end")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run, not a measurement)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per job (default 30, quick 4)")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (4 if args.quick else 30)
    work = Path(tempfile.mkdtemp(prefix="aspen-overhead-"))
    data = {task.name: write_jsonl(work / "data" / f"{task.name}.jsonl", make_rows(task, TRAIN_ROWS, TRAIN_SEED))
            for task in TASKS}
    load_base_tokenizer(args.base_model, work / "state" / "cache")   # both sides start with a warm tokenizer
    log(f"overhead: {len(TASKS)} jobs x {steps} steps on {args.base_model}; {os.cpu_count()} CPUs; work in {work}")

    spec = build_spec(work / "in-process", data, steps).model_copy(update={"base_model": args.base_model})
    base = load_base_model(spec.base_model, dtype=spec.dtype, device=spec.device)
    engine = run_in_process(spec, base)
    del base
    actor_spec = spec.model_copy(update={"output_dir": work / "service"})
    service = run_through_service(actor_spec, work / "state")
    ratio = service["tokens_per_s"] / engine["tokens_per_s"]
    compute_ratio = service["compute_tokens_per_s"] / engine["compute_tokens_per_s"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log("")
    log(f"{'measurement':<52}{'value':>10}  goal")
    log(f"{'in-process engine, tok/s (end to end)':<52}{engine['tokens_per_s']:>10.0f}")
    log(f"{'actor system, tok/s (end to end)':<52}{service['tokens_per_s']:>10.0f}")
    log(f"{'actor system / in-process, end to end':<52}{ratio:>10.3f}  >= 0.95  {'met' if ratio >= 0.95 else 'NOT met'}")
    log(f"{'actor system / in-process, inside fused steps':<52}{compute_ratio:>10.3f}")
    log(f"{'steps that waited for data (actor system)':<52}{service['data_waits']:>10}")
    log(f"load average (1 min) at the end: {load:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"steps_per_job": steps, "in_process": engine, "actor_system": service,
                                         "ratio": ratio, "compute_ratio": compute_ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
