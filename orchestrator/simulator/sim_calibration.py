"""Calibrating the scheduling simulator from a real run: step time and peak memory fitted to a service's
trainer step logs, job start-up delays read from its job table."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np

from orchestrator.simulator.sim_trace import Calibration, StepCost, StepMemory
from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER
from policies.memory_model import MemoryModel, StepShape

# -- calibration from a real run -----------------------------------------------------------------------------

def calibrate(state_dir: Path, base: Calibration | None = None) -> Calibration:
    """Fit the step-time and memory models to a real run's step logs (and the start-up time to its job
    table, where there is one)."""
    state_dir = Path(state_dir)
    logs = sorted(state_dir.glob("trainers/*.jsonl")) or sorted(state_dir.glob("*.jsonl"))
    rows = [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("sequence_lengths")]
    if len(rows) < 4:
        raise ValueError(f"{state_dir}: {len(rows)} logged steps in trainers/*.jsonl; a calibration needs at least 4 "
                         "(run some jobs on the service first)")
    calibration = (base or Calibration()).model_copy()
    tokens = np.array([r["tokens"] for r in rows], dtype=np.float64)
    squares = np.array([sum(n * n for n in r["sequence_lengths"]) for r in rows], dtype=np.float64)
    seconds = np.array([r["seconds"] for r in rows], dtype=np.float64)
    constant, per_token, per_square = nonnegative_fit(np.stack([np.ones_like(tokens), tokens, squares], 1), seconds)
    calibration.step = StepCost(constant=constant, per_token=per_token, per_square=per_square)
    model = MemoryModel([0.0, 0.0, 0.0, float(BYTES_PER_ADAPTER_PARAMETER)], prior_weight=1e-6)
    for row in rows:
        if not row.get("memory_measured", True):   # a CPU step's estimate, not the allocator's count
            continue
        model.observe(StepShape.of(row["sequence_lengths"], row.get("adapter_parameters", 0), row["tokens"]),
                      row["peak_memory_bytes"], row.get("predicted_memory_bytes"))
    c0, c1, c2, c3 = (max(float(v), 0.0) for v in model.coefficients[:4])
    calibration.memory = StepMemory(constant=c0, per_token=c1, per_square=c2, per_parameter=c3)
    calibration.memory_noise = float(model.mean_error or 0.0)
    starts = job_start_delays(state_dir / "jobs.sqlite", rows)
    if starts:
        calibration.job_start_seconds = float(np.median(starts))
    return calibration


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least squares with coefficients ≥ 0 (a negative one is dropped and the rest refitted)."""
    free = list(range(x.shape[1]))
    solution = np.zeros(x.shape[1])
    while free:
        solution = np.zeros(x.shape[1])
        solution[free] = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        negative = [i for i in free if solution[i] < 0]
        if not negative:
            break
        free = [i for i in free if i not in negative]
    return tuple(float(v) for v in solution)


def job_start_delays(table: Path, rows: list[dict]) -> list[float]:
    """Per job: from the decision to start it to the end of its first fused step, minus that step."""
    if not table.exists():
        return []
    db = sqlite3.connect(f"{table.absolute().as_uri()}?mode=ro", uri=True)   # read only: never repairs or creates
    try:
        starts = db.execute("SELECT job_id, MIN(time) FROM transitions WHERE state = 'running' "
                            "GROUP BY job_id").fetchall()
    except sqlite3.DatabaseError as error:   # damaged, not a job table, locked: the calibration cannot use it
        raise ValueError(f"cannot read job start times from {table}: {error}; calibrate from a sound copy (a "
                         f"service keeps one beside it: {table.name}.backup) or from a folder of step logs "
                         f"without it") from error
    finally:
        db.close()
    delays = []
    for job_id, started in starts:
        first = min((r for r in rows if job_id in r.get("jobs", []) and r["time"] >= started), key=lambda r: r["time"],
                    default=None)
        if first is not None:
            delays.append(max(first["time"] - first["seconds"] - started, 0.0))
    return delays
