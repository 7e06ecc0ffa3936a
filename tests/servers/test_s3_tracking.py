"""Experiment tracking for a job whose output is on S3 (a real moto server): event files uploaded, MLflow refused."""

from __future__ import annotations

import json
import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from actors.service.scheduler.local_run import train_locally
from tests.helpers.service import job_dict, run_spec, write_task_data


def test_a_job_on_s3_uploads_its_event_files_and_says_mlflow_needs_a_server(s3_bucket, tiny_base, tiny_model_dirs,
                                                                            tmp_path, monkeypatch, caplog):
    """Output on a storage URI: the event files are written in the staging folder and uploaded to
    `<uri>/tb/` when the job ends; MLflow's file store cannot live there, so without a tracking URI its
    MLflow tracking is off, with a message saying what to set. `aspen export` takes the job's URI."""
    from actors.storage.storage_location import StorageLocation
    from orchestrator.export import export_job

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_task_data(tmp_path / "data", "remote", rows=24)
    uri = f"s3://{s3_bucket}/runs"
    spec = run_spec(str(tiny_model_dirs["llama"]), uri,
                    [job_dict("remote", data, 3, tracking={"tensorboard": True, "mlflow": True})], step_tokens=1024)
    with caplog.at_level(logging.WARNING, logger="actors.service.outputs.tracking"):
        (summary,) = train_locally(spec, base=tiny_base, progress=False)
    assert summary.state == "completed" and summary.steps == 3, summary.reason
    (warning,) = [r.getMessage() for r in caplog.records if "tracking failed" in r.getMessage()]
    assert "storage URI" in warning and "tracking_uri" in warning and "MLFLOW_TRACKING_URI" in warning
    location = StorageLocation(f"{uri}/remote")
    event_files = location.list("tb")
    assert event_files and all(name.startswith("events.out.tfevents") for name in event_files)
    for name in event_files:
        location.download_file(f"tb/{name}", tmp_path / "tb" / name)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    rows = [json.loads(line) for line in location.read_bytes("metrics.jsonl").decode().splitlines()]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in rows]
    exported = export_job(f"{uri}/remote", tmp_path / "remote-lora")
    assert (exported / "adapter_model.safetensors").read_bytes() == location.read_bytes("adapter_model.safetensors")
