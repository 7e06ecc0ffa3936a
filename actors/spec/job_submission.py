"""One job as the service takes it (`JobSubmission`): the job, the base model it trains on and the run's
settings it carries."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator

from actors.spec.base_settings import Dtype, Quantization
from actors.spec.field_types import USER_NAME_PATTERN, Location, Seed, StrictModel
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import needs_full_precision_base


def canonical_base_model(value: str) -> str:
    """A base model as trainers and jobs compare it: an existing local path becomes absolute."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


class JobSubmission(StrictModel):
    """One job as submitted to the service: the job and the base model it trains on."""

    job: JobSpec
    base_model: str = "smollm2-135m"
    quantization: Quantization = "none"
    dtype: Dtype = "auto"
    seed: Seed = 0
    output_dir: Location | None = Field(None, description="the job's own folder, a path or a storage URI (default: "
                                                          "under the service's output root or state folder)")
    user: str | None = Field(None, pattern=USER_NAME_PATTERN, description="who submitted it: set by the HTTP API from "
                                                                         "the request's token (none: an operator, "
                                                                         "through Ray)")

    @field_validator("base_model")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_base_model(value)

    @model_validator(mode="after")
    def _adapter_fits_the_base(self) -> JobSubmission:
        problem = needs_full_precision_base(self.job.lora) if self.quantization != "none" else None
        if problem is not None:
            raise ValueError(f"job '{self.job.name}': {problem} (quantization is {self.quantization})")
        return self
