"""A jobs file, `jobs.yaml` (`RunSpec`): one base model, the run's settings, and the jobs that share them,
each handed to the service as a `JobSubmission`."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from actors.spec.base_settings import Compile, Dtype, Kernels, Layout, Quantization, Recompute
from actors.spec.field_types import Location, Seed, StrictModel
from actors.spec.job_spec import JobSpec, step_limit_problem
from actors.spec.job_submission import JobSubmission
from actors.spec.lora_config import needs_full_precision_base
from actors.spec.tracking_config import TrackingConfig
from actors.spec.trainer_settings import (
    COMPILE_DESCRIPTION,
    KERNELS_DESCRIPTION,
    STAGE_SPLIT_DESCRIPTION,
    STAGES_DESCRIPTION,
    STEP_TOKENS_DESCRIPTION,
    Stages,
    StageSplit,
    StepTokensSetting,
    compile_problem,
    pipeline_problem,
    step_tokens_floor,
)

FOR_A_SERVICE = "for_a_service"
"""Validation context key: the run's jobs are submitted to a running service, which ignores the file's
`step_tokens` (its trainers have their own, against which it checks each job's micro-batch as it is submitted);
the file's own step is not checked then."""

class RunSpec(StrictModel):
    """A `jobs.yaml` file: one base model and the jobs that share it."""

    base_model: str = Field("smollm2-135m", description="an alias (smollm2-135m), a Hugging Face folder, a .gguf "
                                                        "file or a hub id already in the local cache")
    quantization: Quantization = Field("none", description="the frozen base's linear layers "
                                                                           "(bitsandbytes: the `quant` extra)")
    dtype: Dtype = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on CUDA")
    device: str = Field(
        "auto", description="where `aspen run`'s trainer computes: auto (a GPU where there is one, else the CPU), "
                            "cpu, cuda or cuda:N (the index in-process only; on Ray, cuda reserves a GPU and cpu "
                            "none); a GPU this machine lacks is refused, but on a cluster (RAY_ADDRESS); `aspen "
                            "submit`: the service's trainers decide")
    seed: Seed = Field(0, description="seeds data order, adapter initialisation and dropout")
    output_dir: Location = Field(Path("runs/example"), description="one folder per job under it: a path, or a storage "
                                                                  "URI (s3://bucket/prefix, gs://...) where "
                                                                  "checkpoints, adapters and metrics are uploaded")
    step_tokens: StepTokensSetting = Field("auto", description=STEP_TOKENS_DESCRIPTION)
    layout: Layout = Field(
        "packed", description="packed (no padding), padded (each job's rows to its longest) or padded_fused "
                              "(mLoRA: every row to the step's longest)")
    recompute: Recompute = Field(
        "none", description="layers: recompute each decoder layer's activations in backward (less memory, "
                            "more time; the same adapters)")
    compile: Compile = Field("none", description=COMPILE_DESCRIPTION)
    kernels: Kernels = Field("auto", description=KERNELS_DESCRIPTION)
    stages: Stages = Field(1, description=STAGES_DESCRIPTION)
    stage_split: StageSplit = Field("measured", description=STAGE_SPLIT_DESCRIPTION)
    policy: str = Field("adaptive", description="the scheduling policy of `aspen run`'s own service")
    tracking: TrackingConfig | None = Field(None, description="TensorBoard and MLflow tracking of every job that "
                                                              "sets none of its own")
    jobs: list[JobSpec] = Field(min_length=1, description="the jobs (at least one)")

    @field_validator("device")
    @classmethod
    def _a_device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError(f"{value!r} is not one of auto, cpu, cuda or cuda:N (N: a GPU's index, e.g. "
                         "cuda:1); auto takes a GPU where there is one, else the CPU")

    @field_validator("jobs", mode="before")
    @classmethod
    def _a_list(cls, value: object) -> object:
        if isinstance(value, dict):   # else read as a list of its keys, each "not a job"
            first = next(iter(value), "name")
            raise ValueError(f"jobs is a list of jobs, each item starting with '- ', and this gives one mapping: "
                             f"write its first key as '- {first}: ...' and indent the rest of that job under it")
        if value is None or value == []:
            raise ValueError("jobs lists no job: give at least one, each item starting with '- ' (e.g. '- name: "
                             "my-job', then its data and format)")
        return value

    @model_validator(mode="after")
    def _compile_combination(self) -> RunSpec:
        problem = (compile_problem(self.compile, recompute=self.recompute, quantization=self.quantization,
                                   layout=self.layout)
                   or pipeline_problem(self.stages, self.stage_split, quantization=self.quantization, dtype=self.dtype,
                                       layout=self.layout, compile=self.compile, kernels=self.kernels))
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _no_interactive(self) -> RunSpec:
        for index, job in enumerate(self.jobs):
            if job.method == "interactive":
                raise ValueError(f"job '{job.name}' (jobs[{index}]): method interactive is a model of the Tinker API, "
                                 "created by its user's own loop (create_lora_training_client; docs/tinker.md), never "
                                 "submitted; choose sft, dpo, orpo, cpo or grpo")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> RunSpec:
        seen: set[str] = set()
        for index, job in enumerate(self.jobs):
            if job.name in seen:   # located at the second job's name (a jobs file's line), not the file's top
                error = PydanticCustomError("unique_name", "two jobs are named '{name}'; job names must be unique",
                                            {"name": job.name})
                raise ValidationError.from_exception_data(type(self).__name__, [
                    InitErrorDetails(type=error, loc=("jobs", index, "name"), input=job.name)])
            seen.add(job.name)
        return self

    @model_validator(mode="after")
    def _micro_batches_fit_a_step(self, info: ValidationInfo) -> RunSpec:
        if (info.context or {}).get(FOR_A_SERVICE):   # its jobs go to a service, whose trainers' steps decide
            return self
        problems = []
        for index, job in enumerate(self.jobs):
            floor = step_tokens_floor(self.step_tokens)
            limit = (f"{floor}, the most one micro-batch may take with step_tokens: auto" if self.step_tokens == "auto"
                     else None)
            problem = step_limit_problem(job, floor, named=False, limit=limit)
            if problem is None:
                continue
            # the location names the job (jobs[i]); point at batch_size where only it was written
            fields_set = job.model_fields_set
            field = "batch_size" if "batch_size" in fields_set and "max_seq_len" not in fields_set else "max_seq_len"
            error = PydanticCustomError("step_limit", "{problem}", {"problem": problem})
            problems.append(InitErrorDetails(type=error, loc=("jobs", index, field), input=getattr(job, field)))
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self

    @model_validator(mode="after")
    def _adapters_fit_the_base(self) -> RunSpec:
        if self.quantization != "none":
            for job in self.jobs:
                problem = needs_full_precision_base(job.lora)
                if problem is not None:
                    raise ValueError(f"job '{job.name}': {problem} (quantization is {self.quantization})")
        return self

    def _with_tracking(self, job: JobSpec) -> JobSpec:
        """The job, with the run's tracking where it sets none of its own."""
        if job.tracking is not None or self.tracking is None:
            return job
        return job.model_copy(update={"tracking": self.tracking})

    def job_seed(self, job: JobSpec) -> int:
        return self.seed if job.seed is None else job.seed

    def submissions(self) -> list[JobSubmission]:
        """The run's jobs as the service takes them (each carries the run-level settings)."""
        return [JobSubmission(job=self._with_tracking(job), base_model=self.base_model, quantization=self.quantization,
                              dtype=self.dtype, seed=self.job_seed(job), output_dir=self.output_dir / job.name)
                for job in self.jobs]
