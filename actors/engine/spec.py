"""Job and run specifications (pydantic): what a user writes in `jobs.yaml`, validated field by field."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.engine.data import DataFormat

# Safe as a folder name, an MQTT topic level and a module-dict key: no '/', '+', '#', '.', spaces.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"


def canonical_base_model(value: str) -> str:
    """A base model as trainers and jobs compare it: an existing local path becomes absolute."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(StrictModel):
    """One adapter's shape. `target_modules` is a list of module names (matched like PEFT: the full
    dotted name or its last components) or the string `all-linear` (every linear layer but the LM head)."""

    r: int = Field(8, ge=1, le=1024)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    use_rslora: bool = False
    target_modules: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one module name, e.g. [q_proj, v_proj], or 'all-linear'")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r**0.5) if self.use_rslora else self.alpha / self.r


class EarlyStopConfig(StrictModel):
    """Stop a job once further training stops paying off: a power law fitted to its eval losses (or its
    smoothed train loss where it has no eval split) predicts less than `min_improvement` (relative) from
    now to the end of its budget, after at least `patience` + 3 evaluations."""

    min_improvement: float = Field(0.01, ge=0)
    patience: int = Field(3, ge=1, description="evaluations without enough improvement before stopping")


class JobSpec(StrictModel):
    """One fine-tuning job: its data, its adapter and its optimisation."""

    name: str = Field(pattern=JOB_NAME_PATTERN)
    data: Path
    format: DataFormat
    lora: LoraConfig = LoraConfig()
    batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(3e-4, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "linear"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="optimizer steps")
    epochs: float | None = Field(None, gt=0)
    max_seq_len: int = Field(512, ge=8)
    train_on_prompt: bool = False
    eval_split: float = Field(0.0, ge=0)
    eval_every: int | None = Field(None, ge=1, description="optimizer steps between evaluations")
    checkpoint_every: int = Field(50, ge=1, description="optimizer steps between checkpoints")
    early_stop: EarlyStopConfig | None = None
    priority: int = Field(0, description="higher runs first under priority-aware policies")
    seed: int | None = None

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value.lower() in {"trainer", "service", "con", "nul", "aux", "prn"}:
            raise ValueError(f"'{value}' is reserved; choose another job name")
        return value

    @model_validator(mode="after")
    def _has_budget(self) -> JobSpec:
        if self.max_steps is None and self.epochs is None:
            object.__setattr__(self, "epochs", 1.0)
        if self.warmup_steps and self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds max_steps ({self.max_steps})")
        return self


class RunSpec(StrictModel):
    """A `jobs.yaml` file: one base model and the jobs that share it."""

    base_model: str = "smollm2-135m"
    quantization: Literal["none", "int8", "nf4"] = "none"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    seed: int = 0
    output_dir: Path = Path("runs/example")
    step_tokens: int = Field(4096, ge=16)
    layout: Literal["packed", "padded", "padded_fused"] = "packed"
    policy: str = Field("adaptive", description="the scheduling policy of `aspen run`'s own service")
    jobs: list[JobSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> RunSpec:
        seen: set[str] = set()
        for job in self.jobs:
            if job.name in seen:
                raise ValueError(f"two jobs are named '{job.name}'; job names must be unique")
            seen.add(job.name)
        return self

    def job_seed(self, job: JobSpec) -> int:
        return self.seed if job.seed is None else job.seed

    def submissions(self) -> list[JobSubmission]:
        """The run's jobs as the service takes them (each carries the run-level settings)."""
        return [JobSubmission(job=job, base_model=self.base_model, quantization=self.quantization,
                              dtype=self.dtype, seed=self.job_seed(job), output_dir=self.output_dir / job.name)
                for job in self.jobs]


class JobSubmission(StrictModel):
    """One job as submitted to the service: the job and the base model it trains on."""

    job: JobSpec
    base_model: str = "smollm2-135m"
    quantization: Literal["none", "int8", "nf4"] = "none"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0
    output_dir: Path | None = Field(None, description="the job's own folder (default: in the service's state folder)")

    @field_validator("base_model")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_base_model(value)


def planned_steps(spec: JobSpec, num_train_examples: int) -> int:
    """Optimizer steps the job will take: `max_steps`, or what `epochs` of its data gives, the smaller."""
    steps: list[int] = []
    if spec.max_steps is not None:
        steps.append(spec.max_steps)
    if spec.epochs is not None:
        micro_batches = math.ceil(num_train_examples * spec.epochs / spec.batch_size)
        steps.append(max(1, math.ceil(micro_batches / spec.grad_accum)))
    return min(steps)


def cursor_epochs(spec: JobSpec) -> int | None:
    """Epochs the data cursor runs for: bounded by `epochs` unless `max_steps` bounds the job."""
    return math.ceil(spec.epochs) if spec.epochs is not None and spec.max_steps is None else None


def slug(text: str) -> str:
    """A job-name-safe version of any text."""
    cleaned = re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")
    return cleaned[:64] or "job"
