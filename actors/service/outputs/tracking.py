"""Experiment tracking of a job on its trainer (`tracking:` of a job spec): TensorBoard event files in the
job's folder (`<job>/tb`) and an MLflow run per job (a tracking URI from the spec or $MLFLOW_TRACKING_URI,
else a file store in the job's folder, `<job>/mlruns`), with the job's spec as parameters, its loss, learning
rate, gradient norm, tokens and tokens/s per optimizer step and its eval losses as metrics, and its final
adapter as an artefact (`adapter/`).

Tracking never stops training: everything a tracker writes goes through a queue to a thread of the job's own,
so a slow or hung tracking server does not slow the fused steps; a tracker that fails (a bad URI, an
unreachable server, a full disk) is logged once, naming the job, the tracker and the error, and switched off
for that job, and its problem is added to the job's final reason. A resumed job continues its MLflow run
(found by the tag `aspen.job_id`) and its TensorBoard folder (with a purge step: TensorBoard drops the events
of the steps after the checkpoint that an interrupted trainer had written).

A job whose output_dir is a storage URI (s3://...) writes its event files in its node-local staging folder
and uploads them (`<uri>/tb/`) when it leaves its trainer; MLflow's file store cannot live on a storage URI,
so such a job needs a tracking URI (the spec's or $MLFLOW_TRACKING_URI), and without one its MLflow tracking
is off with a message saying so.

mlflow-skinny 3's file store refuses to start unless MLFLOW_ALLOW_FILE_STORE=true (mlflow's opt-out of its
maintenance mode for that store); aspen sets it around its own calls to a file store only."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from actors.service.outputs.job_files import TENSORBOARD_FOLDER
from actors.spec.job_submission import JobSubmission
from actors.spec.tracking_config import MlflowTracking

log = logging.getLogger(__name__)

MLFLOW_FOLDER = "mlruns"
JOB_ID_TAG = "aspen.job_id"
ADAPTER_ARTIFACT_PATH = "adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "aspen.json")
CLOSE_WAIT_S = 30.0          # how long a trainer shutting down waits for its trackers to finish writing
MLFLOW_STATUS = {"completed": "FINISHED", "stopped_early": "FINISHED", "failed": "FAILED", "cancelled": "KILLED",
                 "paused": "SCHEDULED"}
_FILE_STORE_LOCK = threading.Lock()


def tracking_params(submission: JobSubmission) -> dict[str, str]:
    """The job's spec as MLflow parameters: dotted names (`lora.r`), strings as they are, anything else as
    JSON; the base model, quantization, dtype and seed (the one used: the job's own or the run's) of the
    submission beside them. `tracking` itself is left out (a tracking URI may carry credentials)."""
    spec = submission.job.model_dump(mode="json", exclude={"tracking"})
    params: dict[str, str] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)
        else:
            params[prefix] = value if isinstance(value, str) else json.dumps(value)

    add("", spec)
    params.update(base_model=submission.base_model, quantization=submission.quantization, dtype=submission.dtype,
                  seed=str(submission.seed))
    return params


def is_file_store(uri: str) -> bool:
    """Whether an MLflow tracking URI names its file store (a path, or file:///...)."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    """MLFLOW_ALLOW_FILE_STORE=true while aspen calls a file store (module docstring), restored after."""
    if not is_file_store(uri):
        yield
        return
    with _FILE_STORE_LOCK:
        before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
            else:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


@dataclass
class _Op:
    kind: str                      # "step", "eval", "finish"
    step: int
    values: dict[str, float] = field(default_factory=dict)
    state: str = ""
    adapter_dir: Path | None = None
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))


class _TensorBoard:
    name = "TensorBoard"

    def __init__(self, folder: Path, resumed_from: int | None, remote_uri: str | None):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.where = str(folder)
        self.remote_uri = remote_uri
        # a resumed job: TensorBoard drops what an interrupted session wrote for the steps after the checkpoint
        self.writer = SummaryWriter(str(folder), purge_step=resumed_from + 1 if resumed_from else None)

    def start(self, submission: JobSubmission, job_id: str) -> None:
        self.writer.add_text("spec", "```\n" + json.dumps(tracking_params(submission), indent=1) + "\n```", 0)

    def write(self, ops: list[_Op]) -> None:
        for op in ops:
            for key, value in op.values.items():
                self.writer.add_scalar(key, value, op.step, walltime=op.time_ms / 1000)
        self.writer.flush()

    def finish(self, op: _Op) -> None:
        self.writer.close()
        if self.remote_uri is not None:
            from actors.storage.storage_location import StorageLocation

            remote = StorageLocation(self.remote_uri)
            for path in sorted(self.folder.rglob("*")):
                if path.is_file():
                    remote.upload_file(path, f"{TENSORBOARD_FOLDER}/{path.relative_to(self.folder).as_posix()}")

    def abandon(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class _Mlflow:
    name = "MLflow"

    def __init__(self, config: MlflowTracking, default_store: Path | None):
        uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            if default_store is None:
                raise ValueError("the job's output_dir is a storage URI, where MLflow's file store cannot be: set "
                                 "tracking.mlflow.tracking_uri (an MLflow server) in the job's spec, or "
                                 "MLFLOW_TRACKING_URI in the trainers' environment")
            uri = default_store.resolve().as_uri()
        self.uri = uri
        self.where = uri
        self.config = config
        self.run_id = ""
        with _file_store_allowed(uri):
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=uri)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with _file_store_allowed(self.uri):
            return getattr(self.client, method)(*args, **kwargs)

    def start(self, submission: JobSubmission, job_id: str) -> None:
        from mlflow.exceptions import MlflowException

        experiment = self._call("get_experiment_by_name", self.config.experiment)
        if experiment is None:
            try:
                experiment_id = self._call("create_experiment", self.config.experiment)
            except MlflowException:   # another job created it meanwhile
                experiment = self._call("get_experiment_by_name", self.config.experiment)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        runs = self._call("search_runs", [experiment_id], filter_string=f"tags.`{JOB_ID_TAG}` = '{job_id}'",
                          max_results=1)
        if runs:   # a resumed job continues its run; its parameters were logged when it was created
            self.run_id = runs[0].info.run_id
            self._call("update_run", self.run_id, status="RUNNING")
            return
        run = self._call("create_run", experiment_id, run_name=submission.job.name,
                         tags={JOB_ID_TAG: job_id, "aspen.base_model": submission.base_model})
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in tracking_params(submission).items()]
        for start in range(0, len(params), 100):   # log_batch takes at most 100 parameters
            self._call("log_batch", self.run_id, params=params[start:start + 100])

    def write(self, ops: list[_Op]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, op.time_ms, op.step) for op in ops for key, value in op.values.items()]
        for start in range(0, len(metrics), 1000):   # log_batch takes at most 1000 metrics
            self._call("log_batch", self.run_id, metrics=metrics[start:start + 1000])

    def finish(self, op: _Op) -> None:
        if op.adapter_dir is not None:
            for name in ADAPTER_FILES:
                path = op.adapter_dir / name
                if path.is_file():
                    self._call("log_artifact", self.run_id, str(path), ADAPTER_ARTIFACT_PATH)
        status = MLFLOW_STATUS.get(op.state, "FINISHED")
        if status == "SCHEDULED":
            self._call("update_run", self.run_id, status=status)
        else:
            self._call("set_terminated", self.run_id, status=status)

    def abandon(self) -> None:
        pass


class JobTracker:
    """The trackers of one job on its trainer. `step`, `eval` and `finish` only queue (thread-safe, never
    raise); the job's tracking thread writes."""

    def __init__(self, job_id: str, submission: JobSubmission, local_dir: Path, remote_uri: str | None,
                 resumed_from: int | None):
        self.job_id = job_id
        self.submission = submission
        self.local_dir = Path(local_dir)
        self.remote_uri = remote_uri
        self.resumed_from = resumed_from
        self.problems: list[str] = []
        self.queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"aspen-tracking-{job_id}", daemon=True)
        self.thread.start()

    # -- the trainer's side ---------------------------------------------------------------------------
    def step(self, row: dict[str, Any], tokens_per_s: float) -> None:
        values = {f"train/{key}": float(row[key]) for key in ("loss", "lr", "grad_norm", "tokens")
                  if row.get(key) is not None}
        values["train/tokens_per_s"] = float(tokens_per_s)
        self.queue.put(_Op("step", int(row["step"]), values))

    def eval(self, step: int, eval_loss: float, eval_score: float | None = None) -> None:
        values = {"eval/loss": float(eval_loss)}
        if eval_score is not None:
            values["eval/score"] = float(eval_score)
        self.queue.put(_Op("eval", step, values))

    def finish(self, state: str, step: int, adapter_dir: Path | None) -> None:
        """The job left its trainer (`state`); `adapter_dir`: the local folder of its final adapter, if any."""
        self.queue.put(_Op("finish", step, state=state, adapter_dir=adapter_dir))

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)

    # -- the tracking thread --------------------------------------------------------------------------
    def _fail(self, tracker: str, what: str, error: BaseException) -> None:
        problem = f"{tracker} tracking failed while {what}: {type(error).__name__}: {error}"
        problem = problem if len(problem) <= 500 else problem[:497] + "..."
        self.problems.append(problem)
        log.warning("job %s: %s; it is off for this job, which trains on", self.job_id, problem)

    def _open(self) -> list[Any]:
        tracking = self.submission.job.tracking
        assert tracking is not None
        backends: list[Any] = []
        if tracking.tensorboard:
            try:
                backends.append(_TensorBoard(self.local_dir / TENSORBOARD_FOLDER, self.resumed_from, self.remote_uri))
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self._fail("TensorBoard", f"opening {self.local_dir / TENSORBOARD_FOLDER}", error)
        if tracking.mlflow is not None:
            try:
                backends.append(_Mlflow(tracking.mlflow, None if self.remote_uri else self.local_dir / MLFLOW_FOLDER))
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self._fail("MLflow", "connecting", error)
        started = []
        for backend in backends:
            try:
                backend.start(self.submission, self.job_id)
                started.append(backend)
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self._fail(backend.name, f"starting the job's run at {backend.where}", error)
                backend.abandon()
        return started

    def _run(self) -> None:
        try:
            backends = self._open()
            finished = False
            while not finished:
                ops = [self.queue.get()]
                while True:   # what queued up meanwhile goes in one write
                    try:
                        ops.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                finish = next((op for op in ops if op.kind == "finish"), None)
                values = [op for op in ops if op.kind != "finish"]
                for backend in list(backends):
                    try:
                        if values:
                            backend.write(values)
                        if finish is not None:
                            backend.finish(finish)
                    except Exception as error:  # noqa: BLE001 - tracking must never stop training
                        self._fail(backend.name, "writing" if finish is None else "finishing the job's run", error)
                        backend.abandon()
                        backends.remove(backend)
                finished = finish is not None
        except Exception as error:  # noqa: BLE001 - the thread itself must not die silently
            self._fail("tracking", "running", error)
        finally:
            self.done.set()


def start_tracker(job_id: str, submission: JobSubmission, local_dir: Path, remote_uri: str | None,
                  resumed_from: int | None) -> JobTracker | None:
    """The job's tracker, or None where its spec asks for no tracking."""
    tracking = submission.job.tracking
    if tracking is None or (not tracking.tensorboard and tracking.mlflow is None):
        return None
    return JobTracker(job_id, submission, local_dir, remote_uri, resumed_from)
