"""A sweep driven without a service: trials whose loss curve is planted (the best lr known), rounds of reports
until it ends; shared by the sweep, searcher and forecast tests."""

from __future__ import annotations

import math

from actors.service.sweeps.sweep_run import SweepRun
from actors.spec.sweep_spec import SweepSpec

JOB = {"name": "qa", "data": "qa.jsonl", "format": {"type": "alpaca"}, "max_steps": 90, "eval_split": 16,
       "eval_every": 10}
BEST_LR = 3e-4


def spec(**overrides) -> SweepSpec:
    return SweepSpec(**{"name": "lr", "output_dir": "runs/lr", "job": JOB, "trials": 16, "max_concurrent": 4,
                        "space": {"lr": {"loguniform": [1e-5, 1e-2]}, "lora.r": {"choice": [8, 16]}},
                        "stopping": {"asha": {"grace_steps": 10, "reduction": 3}}, **overrides})


def planted_loss(settings: dict, step: int) -> float:
    """Lower the closer lr is to BEST_LR (in log space); falls with the steps; r barely matters."""
    return (1.0 + abs(math.log10(settings["lr"] / BEST_LR))) / math.sqrt(step) + (0.001 if settings.get("lora.r") == 8
                                                                                  else 0.0)


def planted_score(settings: dict, step: int) -> float:
    """A generation metric's score (maximised): higher the lower the planted loss."""
    return 1.0 - planted_loss(settings, step) / 4


def drive(run: SweepRun, rounds: int | None = None, measure=planted_loss) -> list[int]:
    """Advance every running trial by eval_every steps a round; returns the running counts seen."""
    seen, steps = [], {}
    for trial in run.trials.values():
        if trial.state == "running":
            steps[trial.name] = trial.steps
    while not run.done and (rounds is None or rounds > 0):
        for job in run.to_start():
            steps[job.name] = 0
        running = [t for t in run.trials.values() if t.state == "running"]
        seen.append(len(running))
        for trial in running:
            steps[trial.name] += JOB["eval_every"]
            run.report(trial.name, steps[trial.name], measure(trial.settings, steps[trial.name]))
            if trial.state == "running" and steps[trial.name] >= JOB["max_steps"]:
                run.ended(trial.name, "completed", steps[trial.name])
        rounds = None if rounds is None else rounds - 1
    return seen
