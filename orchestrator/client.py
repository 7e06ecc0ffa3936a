"""The Python client: connect to a running aspen service (or start one in this process's Ray), submit
jobs, follow and cancel them.

    from orchestrator.client import Client
    client = Client.local()                       # or Client.connect() to `aspen serve`
    handle = client.submit({"name": "sql", "data": "sql.jsonl", "format": "alpaca", "max_steps": 100})
    handle.wait(timeout=3600)
    print(handle.losses())
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayTaskError

from actors.core.config import NAMESPACE, SCHEDULER_NAME, ServiceConfig
from actors.core.job_table import TERMINAL_STATES, JobRecord
from actors.engine.spec import JobSpec, JobSubmission, RunSpec
from orchestrator.private_ray import start_private_cluster
from orchestrator.spec import SpecError, load_run_spec, parse_run_spec


class ServiceError(RuntimeError):
    """The service refused a request or is not reachable."""


def _call(ref: ray.ObjectRef, timeout: float | None = 120) -> Any:
    """`ray.get`, with the service's own error (not Ray's wrapper) raised."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, (KeyError, ValueError)):
            message = cause.args[0] if cause.args else str(cause)
            raise type(cause)(message) from None
        raise


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> None:
    """Connect to the Ray cluster at `address` (or $RAY_ADDRESS); without either, start a private local
    one (no dashboard: its processes would take CPU from training on small machines)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **init_kwargs)
        return
    init_kwargs.setdefault("include_dashboard", False)
    # Ray starts worker processes at nice 15; a trainer's OpenMP threads then lose every contest with
    # Ray's own processes and each lost slice stalls a whole parallel region (measured: 10-15% slower
    # steps on 2 cores). Our local cluster's workers run at normal priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    start_private_cluster(namespace=NAMESPACE, log_to_driver=False, **init_kwargs)


class JobHandle:
    def __init__(self, client: Client, job_id: str, name: str):
        self.client = client
        self.id = job_id
        self.name = name

    def __repr__(self) -> str:
        return f"JobHandle({self.id!r})"

    def status(self) -> JobRecord:
        return self.client.status(self.id)

    def wait(self, timeout: float | None = None) -> JobRecord:
        return self.client.wait(self.id, timeout)

    def cancel(self) -> JobRecord:
        return self.client.cancel(self.id)

    def losses(self) -> list[dict[str, Any]]:
        """One row per optimizer step: step, loss, tokens, lr, grad_norm, eval_loss (where evaluated)."""
        return self.client.losses(self.id)


class Client:
    def __init__(self, scheduler: ray.actor.ActorHandle, *, owned: bool = False):
        self.scheduler = scheduler
        self.owned = owned   # this client started the service and stops it on `shutdown`

    # -- getting a client --------------------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str = "auto", *, name: str = SCHEDULER_NAME) -> Client:
        """Connect to the service running on a Ray cluster (`aspen serve`)."""
        ensure_ray(address)
        try:
            scheduler = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ServiceError(f"no aspen service ('{name}' in namespace '{NAMESPACE}') on the Ray cluster at "
                               f"{address}; start one with `aspen serve`") from None
        return cls(scheduler)

    @classmethod
    def local(cls, config: ServiceConfig | dict | None = None, *, name: str | None = None,
              address: str | None = None, wait_ready: bool = True, **init_kwargs: Any) -> Client:
        """Start a service for this process (it stops with `shutdown` or when this process ends), on
        the Ray cluster at `address`, or the one `ray.init()` finds or starts."""
        config = ServiceConfig.model_validate(config or {})
        ensure_ray(address, **init_kwargs)
        from actors.scheduler_actor import SchedulerActor

        name = name or f"{SCHEDULER_NAME}-local-{uuid.uuid4().hex[:8]}"
        scheduler = SchedulerActor.options(name=name, namespace=NAMESPACE).remote(config.model_dump_json())
        client = cls(scheduler, owned=True)
        if wait_ready:
            client.wait_ready()
        return client

    @classmethod
    def serve(cls, config: ServiceConfig | dict | None = None, address: str = "auto") -> Client:
        """Start the long-lived, detached service on a Ray cluster, or connect to it if it runs."""
        config = ServiceConfig.model_validate(config or {})
        ensure_ray(address)
        from actors.scheduler_actor import SchedulerActor

        scheduler = SchedulerActor.options(name=SCHEDULER_NAME, namespace=NAMESPACE, lifetime="detached",
                                           get_if_exists=True).remote(config.model_dump_json())
        return cls(scheduler)

    def wait_ready(self, timeout: float = 600) -> dict[str, Any]:
        info = _call(self.scheduler.wait_ready.remote(timeout), timeout=timeout + 30)
        broken = [t for t in info["trainers"] if t.get("error")]
        if broken and len(broken) == len(info["trainers"]):
            raise ServiceError("no trainer could start: " + "; ".join(f"{t['id']}: {t['error']}" for t in broken))
        return info

    def info(self) -> dict[str, Any]:
        return _call(self.scheduler.info.remote())

    # -- submitting ---------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec | JobSubmission | dict | str | Path, *, base_model: str = "smollm2-135m",
               quantization: str = "none", dtype: str = "auto", seed: int = 0,
               output_dir: str | Path | None = None) -> JobHandle:
        """Submit one job: a `JobSpec`, a `JobSubmission`, a dict of job fields, or a jobs YAML file with
        one job (use `submit_run` for several). A bad spec raises `SpecError` here, not later."""
        if isinstance(spec, (str, Path)):
            run = load_run_spec(spec)
            if len(run.jobs) != 1:
                raise SpecError(f"{spec}: has {len(run.jobs)} jobs; submit it with submit_run() (or "
                                "`aspen submit`) to get one handle per job")
            return self.submit_run(run)[0]
        if isinstance(spec, dict):
            if "jobs" in spec:
                run = parse_run_spec(spec, source="<dict>", base_dir=Path.cwd())
                if len(run.jobs) != 1:
                    raise SpecError(f"<dict>: has {len(run.jobs)} jobs; use submit_run() for several")
                return self.submit_run(run)[0]
            run = parse_run_spec({"base_model": base_model, "quantization": quantization, "dtype": dtype,
                                  "seed": seed, "jobs": [spec]}, source="<job>", base_dir=Path.cwd())
            spec = run.jobs[0]
        if isinstance(spec, JobSpec):
            if not spec.data.is_file():
                raise SpecError(f"job '{spec.name}', field data: file {spec.data} does not exist")
            spec = JobSubmission(job=spec, base_model=base_model, quantization=quantization, dtype=dtype,
                                 seed=spec.seed if spec.seed is not None else seed,
                                 output_dir=Path(output_dir).resolve() if output_dir else None)
        return self._submit(spec)

    def submit_run(self, run: RunSpec | str | Path) -> list[JobHandle]:
        """Submit every job of a jobs YAML file (or `RunSpec`) in one request, so that they start together
        and share their trainer's steps from the first (where the policy and memory let them); each keeps
        the run's base model and writes to `<output_dir>/<job name>`."""
        if not isinstance(run, RunSpec):
            run = load_run_spec(run)
        run = run.model_copy(update={"output_dir": Path(run.output_dir).expanduser().resolve()})
        return self._submit_many(run.submissions())

    def _submit(self, submission: JobSubmission) -> JobHandle:
        return self._submit_many([submission])[0]

    def _submit_many(self, submissions: list[JobSubmission]) -> list[JobHandle]:
        records: list[JobRecord] = _call(self.scheduler.submit_many.remote([s.model_dump_json() for s in submissions]))
        return [JobHandle(self, record.id, record.name) for record in records]

    # -- following ----------------------------------------------------------------------------------------
    def jobs(self, states: Iterable[str] | None = None) -> list[JobRecord]:
        return _call(self.scheduler.jobs.remote(tuple(states) if states else None))

    def status(self, job: str) -> JobRecord:
        return _call(self.scheduler.status.remote(job))

    def handle(self, job: str) -> JobHandle:
        record = self.status(job)
        return JobHandle(self, record.id, record.name)

    def losses(self, job: str) -> list[dict[str, Any]]:
        return _call(self.scheduler.progress.remote(job))

    def transitions(self, job: str) -> list[tuple[float, str, str]]:
        return _call(self.scheduler.transitions.remote(job))

    def trainers(self) -> list[dict[str, Any]]:
        return _call(self.scheduler.trainers.remote())

    def cancel(self, job: str) -> JobRecord:
        return _call(self.scheduler.cancel.remote(job))

    def pause(self, job: str) -> JobRecord:
        return _call(self.scheduler.pause.remote(job))

    def resume(self, job: str) -> JobRecord:
        return _call(self.scheduler.resume.remote(job))

    def wait(self, job: str, timeout: float | None = None, poll: float = 0.5) -> JobRecord:
        """Block until the job has ended (completed, stopped early, failed or cancelled)."""
        deadline = None if timeout is None else time.time() + timeout
        while True:
            record = self.status(job)
            if record.state in TERMINAL_STATES:
                return record
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"job {record.id} is still {record.state} ({record.reason}) after {timeout}s")
            time.sleep(poll)

    def wait_all(self, jobs: Iterable[str], timeout: float | None = None, poll: float = 0.5) -> list[JobRecord]:
        deadline = None if timeout is None else time.time() + timeout
        return [self.wait(job, None if deadline is None else max(deadline - time.time(), 0), poll) for job in jobs]

    def shutdown(self) -> None:
        """Stop the service: running jobs are checkpointed (and resume when it starts again)."""
        try:
            _call(self.scheduler.shutdown.remote(), timeout=300)
        finally:
            ray.kill(self.scheduler)
