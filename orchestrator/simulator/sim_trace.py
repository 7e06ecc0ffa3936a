"""A job trace for the scheduling simulator (`orchestrator.simulator.simulate`): the trainers, the calibration (what a
fused step costs in seconds and memory, how long a job takes to start) and the jobs (arrival, size,
shapes, priority, rank, loss curve), validated from YAML or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.memory_model import StepShape

# -- the trace ----------------------------------------------------------------------------------------------

class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepCost(Strict):
    """Seconds of one fused step: constant + per_token·T + per_square·ΣL²."""

    constant: float = Field(0.05, ge=0)
    per_token: float = Field(0.004, ge=0)
    per_square: float = Field(0.0, ge=0)

    def seconds(self, tokens: int, sum_squares: int) -> float:
        return self.constant + self.per_token * tokens + self.per_square * sum_squares


class StepMemory(Strict):
    """Peak bytes of one fused step (the memory model's four coefficients)."""

    constant: float = Field(1.2e9, ge=0)
    per_token: float = Field(2.0e5, ge=0)
    per_square: float = Field(0.0, ge=0)
    per_parameter: float = Field(16.0, ge=0)

    def peak(self, shape: StepShape) -> int:
        return int(self.constant + self.per_token * shape.tokens + self.per_square * shape.sum_squared_lengths
                   + self.per_parameter * shape.adapter_parameters)


class Calibration(Strict):
    step: StepCost = StepCost()
    memory: StepMemory = StepMemory()
    job_start_seconds: float = Field(1.0, ge=0, description="from a start decision to the job's first step")
    checkpoint_seconds: float = Field(0.5, ge=0, description="a preempted job's checkpoint at its step boundary")
    memory_noise: float = Field(0.0, ge=0, description="relative error of the memory model: true peaks vary by "
                                                      "this much (normal), so budgets cut too close can OOM")


class TrainerSpec(Strict):
    id: str = "trainer-0"
    memory_budget_bytes: int = Field(ge=1)
    step_tokens: int = Field(4096, ge=16)
    layout: Literal["packed", "padded", "padded_fused"] = "packed"
    max_jobs: int | None = None
    stages: int = Field(1, ge=1, le=64, description="a pipeline trainer: the base cut into this many stages, each "
                        "on its own device holding 1/stages of the layers; memory_budget_bytes is each stage's")
    transfer_seconds: float = Field(0.0, ge=0, description="a pipeline trainer: an activation's (or its "
                                    "gradient's) time from one stage to the next")


class Lengths(Strict):
    """Sequence lengths in tokens: a clipped normal."""

    mean: float = Field(gt=0)
    std: float = Field(0.0, ge=0)
    min: int = Field(8, ge=1)
    max: int = Field(2048, ge=1)


class LossCurve(Strict):
    """Eval loss at optimizer step s: floor + (initial − floor)·(1 + s/scale)^(−rate), plus noise."""

    initial: float = 2.5
    floor: float = 1.0
    scale: float = Field(20.0, gt=0)
    rate: float = Field(1.0, gt=0)
    noise: float = Field(0.005, ge=0, description="relative")

    def at(self, step: int, rng: np.random.Generator) -> float:
        clean = self.floor + (self.initial - self.floor) * (1 + step / self.scale) ** (-self.rate)
        return clean * (1 + self.noise * rng.standard_normal())


class EarlyStop(Strict):
    min_improvement: float = 0.01
    patience: int = 3
    min_delta: float | None = Field(None, ge=0, description="absolute (loss units; null: 0.1% of the first loss)")


class TraceJob(Strict):
    name: str
    arrival: float = Field(0.0, ge=0, description="seconds after the trace starts")
    steps: int = Field(ge=1, description="optimizer steps (the job's budget)")
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    lengths: Lengths
    priority: int = 0
    rank: int = Field(8, ge=1)
    loss: LossCurve = LossCurve()
    eval_every: int = Field(10, ge=1)
    early_stop: EarlyStop | None = None
    user: str | None = Field(None, description="who submitted it (a name of the trace's `users`; none: an operator)")


class Trace(Strict):
    name: str = "trace"
    seed: int = 0
    trainers: list[TrainerSpec] = Field(min_length=1)
    base_model: str = "smollm2-135m"
    parameters_per_rank: int = Field(57_600, ge=1, description="adapter parameters per LoRA rank (default: "
                                                                "q_proj + v_proj of smollm2-135m)")
    calibration: Calibration = Calibration()
    tick_seconds: float = Field(0.25, gt=0, description="the scheduler decides on new jobs at these intervals")
    users: dict[str, float] = Field({}, description="each user's share (weight) of the fair share")
    fair_share_window_s: float = Field(3600.0, gt=0, description="the window of trained tokens the fair share "
                                                                  "counts")
    jobs: list[TraceJob] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_users(self) -> Trace:
        unknown = sorted({job.user for job in self.jobs if job.user is not None} - set(self.users))
        if unknown:
            raise ValueError(f"jobs name users {unknown} that `users` does not list (with their shares)")
        return self


def load_trace(path: Path) -> Trace:
    text = Path(path).read_text()
    data = yaml.safe_load(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    try:
        return Trace.model_validate(data)
    except Exception as error:
        raise ValueError(f"{path}: not a valid trace: {error}") from error
