"""Experiment tracking of a job (`tracking:` of a job or of a run): TensorBoard event files and an MLflow run
per job."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from actors.spec.field_types import StrictModel


class MlflowTracking(StrictModel):
    """Where a job's MLflow run goes: one run per job (found again by its job id when the job resumes),
    with the job's spec as parameters, its loss, eval loss, learning rate, gradient norm and tokens/s as
    metrics per optimizer step, and its final adapter as an artefact (`adapter/`)."""

    tracking_uri: str | None = Field(
        None, description="an MLflow tracking URI (http://host:5000, file:///mnt/mlruns, databricks, ...); null: "
                          "$MLFLOW_TRACKING_URI of the trainer's process, else a file store in the job's folder "
                          "(<job>/mlruns; aspen sets MLFLOW_ALLOW_FILE_STORE=true, mlflow's opt-in to its "
                          "file store, while it writes there)")
    experiment: str = Field("aspen", min_length=1, max_length=500, description="the MLflow experiment's name")


class TrackingConfig(StrictModel):
    """Experiment tracking of a job. A tracker that fails (a bad URI, an unreachable server, a full disk)
    is logged once and switched off for that job; the job trains on."""

    tensorboard: bool = Field(False, description="TensorBoard event files in the job's folder (<job>/tb): "
                                                 "`tensorboard --logdir <output_dir>`")
    mlflow: MlflowTracking | None = Field(None, description="an MLflow run per job: `true` (the defaults) or "
                                                            "{tracking_uri, experiment}")

    @field_validator("mlflow", mode="before")
    @classmethod
    def _bool_means_defaults(cls, value: Any) -> Any:
        if value is True:
            return MlflowTracking()
        if value is False:
            return None
        return value
