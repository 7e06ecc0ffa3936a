#!/usr/bin/env python
"""Benchmark of the predictive early stop on real data: steps and tokens it saves, and what it costs in
final eval loss, measured side by side in one fused run.

Every plateauing job is trained twice in the same `TrainerLoop` (in-process, `LocalJobLink` + `JobData`,
so the real stop rule decides): a copy with `early_stop` and an identical copy (same data, split, seed
and adapter initialisation) without it. Fused adapters are isolated, so both copies follow the same
trajectory until the stop (checked: their eval losses at the stop step are compared); the copy without
early stop gives the full budget's final eval loss. A "still improving" control job (more data, a budget
well before its plateau) runs with `early_stop` too: the rule must not stop it.

Goals (issue 4): >= 30% of the steps saved on plateauing jobs (all their budgets' steps together; each
job's share is printed too), and the early-stopped job's final eval loss within 1% of the full run's
(|stop - full| / full <= 1%, or the early-stopped loss is lower; the full run's best eval loss is shown
next to it). A job counts as plateauing when the full run's eval loss improved by < 1% over its last
third (a rise, i.e. overfitting, counts).

The data are the public sets in `../shared/data` (GSM8K, Code Alpaca, Alpaca seed tasks): small seeded
subsets, written to a temporary folder in the formats the project reads.

Usage: python bench/early_stop.py [--quick] [--data DIR] [--base-model smollm2-135m] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch

from actors.engine.models import BaseModel, load_base_model
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.service.trainer.trainer_reports import TrainerEvent
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from bench.machine import cpu_model

DEFAULT_DATA_DIR = REPO.parent / "shared" / "data"
DATA_FILES = ("gsm8k_train.jsonl", "code_alpaca_2k.json", "alpaca_seed_tasks.jsonl")
EARLY_STOP = {"min_improvement": 0.01, "patience": 3}   # the rule's defaults, as a user would write them
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
GOAL_SAVED = 0.30
GOAL_LOSS = 0.01
PLATEAU = 0.01          # the full run's eval loss improved by less than this over its last third
SEED = 0


def log(message: str) -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------

def read_json_rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def gsm8k_rows(data_dir: Path) -> list[dict]:
    return read_json_rows(data_dir / "gsm8k_train.jsonl")


def code_alpaca_rows(data_dir: Path) -> list[dict]:
    return read_json_rows(data_dir / "code_alpaca_2k.json")


def seed_task_rows(data_dir: Path) -> list[dict]:
    """Alpaca seed tasks flattened to alpaca rows: one per (instruction, instance)."""
    rows = []
    for task in read_json_rows(data_dir / "alpaca_seed_tasks.jsonl"):
        for instance in task["instances"]:
            rows.append({"instruction": task["instruction"], "input": instance.get("input", ""),
                         "output": instance["output"]})
    return rows


GSM8K_FORMAT = {"type": "prompt_response", "prompt": "Question: {question}\nAnswer:", "response": " {answer}"}
ALPACA_FORMAT = {"type": "alpaca"}


@dataclass(frozen=True)
class Task:
    """One benchmark job: a seeded subset of a real data file and its training settings."""

    name: str
    rows: Callable[[Path], list[dict]]
    format: dict
    subset: int                 # rows taken (train + eval)
    eval_rows: int
    budget: dict                # max_steps and/or epochs
    lr: float
    control: bool = False       # "still improving": the rule must not stop it
    batch_size: int = 4
    max_seq_len: int = 128
    eval_every: int = 5

    def job(self, name: str, data: Path, early_stop: bool) -> dict:
        return {"name": name, "data": str(data), "format": self.format, "lora": LORA,
                "batch_size": self.batch_size, "lr": self.lr, "lr_schedule": "constant",
                "max_grad_norm": 1.0, "max_seq_len": self.max_seq_len, "eval_split": self.eval_rows,
                "eval_every": self.eval_every, "checkpoint_every": 10_000, "seed": SEED,
                **self.budget, **({"early_stop": EARLY_STOP} if early_stop else {})}


def tasks_for(quick: bool) -> list[Task]:
    """Plateauing jobs: small subsets, several epochs, a constant learning rate. The control: thousands of
    rows, a gentler learning rate and a budget of well under one epoch."""
    if quick:
        return [Task("code-alpaca", code_alpaca_rows, ALPACA_FORMAT, subset=20, eval_rows=4,
                     budget={"epochs": 4}, lr=1e-3, batch_size=2, max_seq_len=96, eval_every=3),
                Task("gsm8k-control", gsm8k_rows, GSM8K_FORMAT, subset=1000, eval_rows=4,
                     budget={"max_steps": 18}, lr=3e-4, control=True, batch_size=2, max_seq_len=96,
                     eval_every=3)]
    plateau = {"subset": 40, "eval_rows": 8, "budget": {"epochs": 6}, "lr": 3e-4, "batch_size": 2,
               "max_seq_len": 96, "eval_every": 4}
    return [Task("code-alpaca", code_alpaca_rows, ALPACA_FORMAT, **plateau),
            Task("seed-tasks", seed_task_rows, ALPACA_FORMAT, **plateau),
            Task("gsm8k-control", gsm8k_rows, GSM8K_FORMAT, subset=2000, eval_rows=8, budget={"max_steps": 60},
                 lr=3e-4, control=True, batch_size=2, max_seq_len=96, eval_every=4)]


def check_data_dir(data_dir: Path) -> None:
    missing = [name for name in DATA_FILES if not (data_dir / name).is_file()]
    if missing:
        raise SystemExit(f"early_stop benchmark: the real data is missing: looked for {', '.join(missing)} in "
                         f"{data_dir}; pass the folder holding {', '.join(DATA_FILES)} with --data DIR")


def write_subset(task: Task, data_dir: Path, folder: Path) -> Path:
    rows = task.rows(data_dir)
    if len(rows) < task.subset:
        raise SystemExit(f"{task.name}: {data_dir} holds {len(rows)} rows, the benchmark needs {task.subset}")
    chosen = random.Random(f"{task.name}-{SEED}").sample(rows, task.subset)
    path = folder / f"{task.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in chosen))
    return path


# --------------------------------------------------------------------------------------------------
# the fused run
# --------------------------------------------------------------------------------------------------

@dataclass
class JobRun:
    """What one job copy did in the fused run."""

    name: str
    total_steps: int = 0
    evals: dict[int, float] = field(default_factory=dict)
    end: str = ""
    end_step: int = 0
    tokens: int = 0
    reason: str = ""
    predictions: list[tuple[int, int]] = field(default_factory=list)

    @property
    def final_eval(self) -> float:
        return self.evals[max(self.evals)]


def assignment_for(submission: JobSubmission, job_id: str, base: BaseModel) -> Assignment:
    data = JobData(job_id, submission, base.tokenizer)
    summary = data.prepare()
    return Assignment(job_id=job_id, submission=submission, output_dir=Path(submission.output_dir), data=summary,
                      eval_examples=data.eval_examples(), link=LocalJobLink(data))


def run_fused(spec: RunSpec, base: BaseModel, state_dir: Path) -> tuple[dict[str, JobRun], dict[str, Any]]:
    """Train every job of `spec` in one in-process TrainerLoop until all have ended."""
    config = TrainerConfig(base_model=spec.base_model, step_tokens=spec.step_tokens, prefetch=2)
    loop = TrainerLoop(base, config, "trainer-bench", state_dir)
    runs = {job.name: JobRun(job.name) for job in spec.jobs}
    loop.assign([assignment_for(s, s.job.name, base) for s in spec.submissions()])
    started = time.perf_counter()
    steps, step_seconds, step_tokens = 0, 0.0, 0
    try:
        while True:
            report = loop.run_once(idle_wait=0)
            if report is not None:
                steps += 1
                step_seconds += report.seconds
                step_tokens += report.tokens - report.padding_tokens
            for event in loop.drain_events():
                note(runs, event, time.perf_counter() - started)
            if not loop.active and loop.commands.empty():
                break
    finally:
        loop.close()
    seconds = time.perf_counter() - started
    return runs, {"fused_steps": steps, "wall_seconds": seconds, "step_seconds": step_seconds,
                  "tokens": step_tokens, "tokens_per_s": step_tokens / max(step_seconds, 1e-9)}


def note(runs: dict[str, JobRun], event: TrainerEvent, elapsed: float) -> None:
    run = runs.get(event.job_id)
    if run is None:
        return
    if event.kind == "started":
        run.total_steps = event.data["total_steps"]
    elif event.kind == "eval":
        run.evals[event.step] = event.data["eval_loss"]
        log(f"  [{elapsed:6.0f}s] {run.name:<22} step {event.step:>4}/{run.total_steps}  "
            f"eval loss {event.data['eval_loss']:.4f}")
    elif event.kind == "prediction":
        run.predictions.append((event.step, event.data["predicted_stop_step"]))
    elif event.kind in ("completed", "stopped_early", "failed", "cancelled", "paused"):
        run.end, run.end_step, run.reason = event.kind, event.step, event.data.get("reason", "")
        run.tokens = event.data.get("tokens", 0)
        if "eval_loss" in event.data:
            run.evals[event.step] = event.data["eval_loss"]
        log(f"  [{elapsed:6.0f}s] {run.name:<22} {event.kind} at step {event.step}: {run.reason}")


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------

def eval_at_or_before(evals: dict[int, float], step: int) -> tuple[int, float]:
    best = max(s for s in evals if s <= step)
    return best, evals[best]


def plateau_improvement(evals: dict[int, float], budget: int) -> float:
    """Relative improvement of the eval loss over the run's last third (from the last eval at or before
    two thirds of the budget to the final one)."""
    _, before = eval_at_or_before(evals, round(budget * 2 / 3))
    final = evals[max(evals)]
    return (before - final) / before


def summarize(task: Task, stop: JobRun, full: JobRun | None) -> dict[str, Any]:
    budget = stop.total_steps
    row: dict[str, Any] = {"job": task.name, "control": task.control, "budget_steps": budget,
                           "steps": stop.end_step, "end": stop.end, "reason": stop.reason,
                           "saved": 1 - stop.end_step / budget, "stop_eval_loss": stop.final_eval,
                           "eval_losses": {str(s): v for s, v in sorted(stop.evals.items())},
                           "predicted_stop_steps": stop.predictions, "tokens": stop.tokens}
    reference = full if full is not None else stop
    row["full_eval_loss"] = reference.final_eval
    row["full_tokens"] = reference.tokens
    row["tokens_saved"] = reference.tokens - stop.tokens
    row["plateau_improvement"] = plateau_improvement(reference.evals, reference.total_steps)
    row["plateaued"] = row["plateau_improvement"] < PLATEAU
    row["loss_difference"] = (stop.final_eval - reference.final_eval) / reference.final_eval
    if full is not None:
        row["full_eval_losses"] = {str(s): v for s, v in sorted(full.evals.items())}
        at = eval_at_or_before(full.evals, stop.end_step)
        row["twin_difference_at_stop"] = (abs(stop.final_eval - at[1]) / at[1]
                                          if at[0] == stop.end_step else None)
        row["full_best_eval_loss"] = min(full.evals.values())
    return row


def machine_line() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def print_table(rows: list[dict[str, Any]]) -> None:
    log("")
    log(f"{'job':<22}{'budget':>7}{'trained':>8}{'saved':>7}{'eval @stop':>11}{'full final':>11}{'diff':>8}"
        f"{'full best':>10}{'last 1/3':>9}  plateau  end")
    for row in rows:
        log(f"{row['job'] + (' (control)' if row['control'] else ''):<22}{row['budget_steps']:>7}{row['steps']:>8}"
            f"{row['saved']:>7.0%}{row['stop_eval_loss']:>11.4f}{row['full_eval_loss']:>11.4f}"
            f"{row['loss_difference']:>+8.2%}{row.get('full_best_eval_loss', min(row['eval_losses'].values())):>10.4f}"
            f"{row['plateau_improvement']:>9.2%}  "
            f"{'yes' if row['plateaued'] else 'no':<7}  {row['end']}")


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    plateaued = [r for r in rows if not r["control"] and r["plateaued"]]
    stopped = [r for r in rows if not r["control"] and r["end"] == "stopped_early"]
    controls = [r for r in rows if r["control"]]
    budget = sum(r["budget_steps"] for r in plateaued)
    saved_steps = sum(r["budget_steps"] - r["steps"] for r in plateaued)
    overall = saved_steps / budget if budget else 0.0
    each = [r["saved"] >= GOAL_SAVED for r in plateaued]
    within = [r["loss_difference"] <= GOAL_LOSS for r in stopped]
    jobs = [r for r in rows if not r["control"]]
    tokens_full = sum(r["full_tokens"] for r in jobs)
    tokens_saved = sum(r["tokens_saved"] for r in jobs)
    result = {"plateaued_jobs": len(plateaued), "steps_saved_overall": overall,
              "steps_goal_met_each": sum(each), "steps_goal_met": bool(plateaued) and overall >= GOAL_SAVED,
              "stopped_jobs": len(stopped), "loss_within_goal": sum(within),
              "loss_goal_met": bool(stopped) and all(within),
              "max_loss_difference": max((r["loss_difference"] for r in stopped), default=None),
              "tokens_saved": tokens_saved, "tokens_full": tokens_full,
              "tokens_saved_share": tokens_saved / tokens_full if tokens_full else 0.0,
              "controls_not_stopped": all(r["end"] != "stopped_early" for r in controls),
              "controls_still_improving": all(not r["plateaued"] for r in controls)}
    log("")
    short = ", ".join(f"{r['job']} {r['saved']:.0%}" for r in plateaued if r["saved"] < GOAL_SAVED)
    log(f"steps saved on plateauing jobs (goal >= {GOAL_SAVED:.0%} of their budgets' steps): {overall:.0%} "
        f"({saved_steps} of {budget})  {'met' if result['steps_goal_met'] else 'NOT met'}; per job "
        f"{sum(each)} of {len(plateaued)}" + (f" (below: {short})" if short else ""))
    worst = result["max_loss_difference"]
    detail = (f"{sum(within)} of {len(stopped)} stopped jobs, worst {worst:+.2%}" if worst is not None
              else "no job stopped early")
    log(f"final eval loss, early-stopped vs full (<= +{GOAL_LOSS:.0%}; lower is fine): {detail}  "
        f"{'met' if result['loss_goal_met'] else 'NOT met'}")
    log(f"tokens saved (plateau jobs, training tokens): {tokens_saved} of {tokens_full} "
        f"({result['tokens_saved_share']:.0%})")
    for r in controls:
        log(f"control {r['job']}: {r['end']} at step {r['steps']} of {r['budget_steps']}, eval loss improved "
            f"{r['plateau_improvement']:.1%} over its last third  "
            f"{'met (not stopped)' if r['end'] != 'stopped_early' else 'NOT met (stopped)'}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small job and the control (a sanity run)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="folder of the real data files")
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--step-tokens", type=int, default=8192, help="a fused step's token budget")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 holds up better on a shared machine)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_data_dir(args.data)
    tasks = tasks_for(args.quick)
    work = Path(tempfile.mkdtemp(prefix="aspen-early-stop-"))
    jobs = []
    for task in tasks:
        path = write_subset(task, args.data, work / "data")
        jobs.append(task.job(f"{task.name}-stop", path, early_stop=True))
        if not task.control:
            jobs.append(task.job(f"{task.name}-full", path, early_stop=False))
    spec = RunSpec.model_validate({"base_model": args.base_model, "dtype": "float32", "device": "cpu",
                                   "seed": SEED, "output_dir": str(work / "out"),
                                   "step_tokens": args.step_tokens, "jobs": jobs})
    log(f"early stop on real data: {len(tasks)} jobs ({len(jobs)} copies in one fused run) on "
        f"{args.base_model}; {machine_line()}; work in {work}")
    base = load_base_model(spec.base_model, dtype="float32", device="cpu")
    runs, totals = run_fused(spec, base, work / "state")
    failed = [r for r in runs.values() if r.end not in ("completed", "stopped_early")]
    if failed:
        raise SystemExit(f"jobs did not finish: {[(r.name, r.end, r.reason) for r in failed]}")
    rows = [summarize(task, runs[f"{task.name}-stop"], None if task.control else runs[f"{task.name}-full"])
            for task in tasks]
    print_table(rows)
    twins = [r["twin_difference_at_stop"] for r in rows if r.get("twin_difference_at_stop") is not None]
    if twins:
        log(f"twins' eval losses at the stop step differ by at most {max(twins):.1e} (relative)")
    log(f"fused run: {totals['fused_steps']} steps, {totals['tokens']} tokens, {totals['wall_seconds']:.0f}s "
        f"({totals['tokens_per_s']:.0f} tokens/s inside steps)")
    result = verdicts(rows)
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "machine": machine_line(), "run": totals,
                                         "early_stop": EARLY_STOP, "jobs": rows, "verdicts": result,
                                         "settings": [{k: v for k, v in task.__dict__.items() if k != "rows"}
                                                      for task in tasks]}, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
