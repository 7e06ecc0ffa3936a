"""Experiment tracking (`tracking:` of a job): a tiny model trained in this process with TensorBoard and
MLflow on, read back with each library's own reader (TensorBoard's EventAccumulator, MLflow's MlflowClient):
the scalars and the metric histories equal the job's metrics.jsonl and eval losses, the run's parameters
equal the job's spec, the final adapter is the run's artefact; and a tracker that cannot write (an MLflow
server that does not answer, a file store under a file) costs the job nothing but its tracking."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from actors.service.scheduler.local_run import train_locally
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, run_spec, write_task_data

STEPS = 6


def flat_spec(value, prefix=""):
    """A job spec as dotted names -> MLflow parameter strings (strings as they are, the rest as JSON)."""
    if isinstance(value, dict) and value:
        out = {}
        for key, inner in value.items():
            out.update(flat_spec(inner, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def metrics_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_and_mlflow_read_back(tiny_base, tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = write_task_data(tmp_path / "data", "add", rows=40)
    job = job_dict("add", data, STEPS, eval_split=8, eval_every=2,
                   tracking={"tensorboard": True, "mlflow": True})
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job], step_tokens=1024)
    (summary,) = train_locally(spec, base=tiny_base, progress=False)
    assert summary.state == "completed" and summary.steps == STEPS, summary.reason
    folder = tmp_path / "out" / "add"
    rows = metrics_rows(folder)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))

    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [row["step"] for row in rows]
    assert [e.value for e in loss] == pytest.approx([row["loss"] for row in rows], rel=1e-6)   # float32 there
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([row["lr"] for row in rows], rel=1e-6)
    tb_evals = events.Scalars("eval/loss")
    assert [e.step for e in tb_evals] == [step for step, _ in summary.evals] == [2, 4, 6]
    assert [e.value for e in tb_evals] == pytest.approx([value for _, value in summary.evals], rel=1e-6)
    assert len(events.Scalars("train/tokens_per_s")) == STEPS and all(
        e.value > 0 for e in events.Scalars("train/tokens_per_s"))

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # reading mlflow's file store needs its opt-in too
    client = MlflowClient(tracking_uri=(folder / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("aspen")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "add" and run.data.tags["aspen.job_id"] == "add"
    submission = spec.submissions()[0]
    expected = flat_spec(submission.job.model_dump(mode="json", exclude={"tracking"}))
    expected.update(base_model=submission.base_model, quantization="none", dtype="auto", seed="0")
    assert run.data.params == expected
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(row["step"], row["loss"]) for row in rows]   # exact
    evals = client.get_metric_history(run.info.run_id, "eval/loss")
    assert sorted((m.step, m.value) for m in evals) == summary.evals
    tokens = client.get_metric_history(run.info.run_id, "train/tokens")
    assert sorted((m.step, m.value) for m in tokens) == [(row["step"], row["tokens"]) for row in rows]
    artefacts = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= artefacts
    downloaded = Path(client.download_artifacts(run.info.run_id, "adapter/adapter_model.safetensors",
                                                str(tmp_path / "download")))
    assert downloaded.read_bytes() == (folder / "adapter_model.safetensors").read_bytes()


def test_a_failing_tracker_leaves_training_intact(tiny_base, tiny_model_dirs, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")   # the unanswered server fails at once, not in minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    data = write_task_data(tmp_path / "data", "add", rows=24)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    server = f"http://127.0.0.1:{free_port()}"
    jobs = [job_dict("no-server", data, 3, tracking={"tensorboard": True, "mlflow": {"tracking_uri": server}}),
            job_dict("no-disk", data, 3, tracking={"mlflow": {"tracking_uri": str(blocker / "mlruns")}}),
            job_dict("plain", data, 3)]
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", jobs, step_tokens=1024)
    with caplog.at_level(logging.WARNING, logger="actors.service.outputs.tracking"):
        summaries = {s.name: s for s in train_locally(spec, base=tiny_base, progress=False)}
    for name in ("no-server", "no-disk", "plain"):
        assert summaries[name].state == "completed" and summaries[name].steps == 3, summaries[name].reason
        assert len(metrics_rows(tmp_path / "out" / name)) == 3
        assert (tmp_path / "out" / name / "adapter_model.safetensors").is_file()
    # the same data, seed and spec trained alongside: the tracked jobs' losses are the untracked one's
    plain = [row["loss"] for row in metrics_rows(tmp_path / "out" / "plain")]
    assert [row["loss"] for row in metrics_rows(tmp_path / "out" / "no-server")] == plain
    warnings = [r.getMessage() for r in caplog.records if "tracking failed" in r.getMessage()]
    assert len(warnings) == 2, warnings   # once per job, however many steps it went on for
    (no_server,) = [w for w in warnings if "job no-server:" in w]
    (no_disk,) = [w for w in warnings if "job no-disk:" in w]
    assert "MLflow tracking failed" in no_server and "127.0.0.1" in no_server and "trains on" in no_server
    assert "MLflow tracking failed" in no_disk and "a-file" in no_disk
    # TensorBoard of the job whose MLflow failed still wrote every step
    events = EventAccumulator(str(tmp_path / "out" / "no-server" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]


def test_a_resumed_job_continues_its_run_and_tensorboard_drops_the_lost_steps(tmp_path, monkeypatch):
    """A job paused at step 4 whose trainer died after step 4 resumes from its checkpoint at step 2: the
    same MLflow run goes on (status SCHEDULED while paused), and TensorBoard shows the resumed session's
    values for steps 3 and 4, not the lost ones."""
    from actors.service.outputs.tracking import start_tracker
    from actors.spec.job_spec import JobSpec
    from actors.spec.job_submission import JobSubmission

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = JobSpec(name="resumed", data="unused.jsonl", format={"type": "text"}, max_steps=5,
                   tracking={"tensorboard": True, "mlflow": True})
    submission = JobSubmission(job=spec)
    first = start_tracker("resumed-1", submission, tmp_path, None, None)
    for step in (1, 2, 3, 4):
        first.step({"step": step, "loss": 10.0 - step, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100}, 50.0)
    first.finish("paused", 4, None)
    assert first.wait(60) and not first.problems
    second = start_tracker("resumed-1", submission, tmp_path, None, resumed_from=2)
    for step in (3, 4, 5):
        second.step({"step": step, "loss": 20.0 - step, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100}, 50.0)
    second.finish("completed", 5, None)
    assert second.wait(60) and not second.problems

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 9), (2, 8), (3, 17), (4, 16), (5, 15)]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("aspen").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "5"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert history[-1] == (5, 15) and {(3, 17), (4, 16)} <= set(history)   # MLflow keeps both sessions' points
