"""The Python client: connect to a running aspen service (or start one in this process's Ray), submit
jobs, follow and cancel them.

    from orchestrator.client import Client
    client = Client.local()                       # or Client.connect() to `aspen serve`
    handle = client.submit({"name": "sql", "data": "sql.jsonl", "format": "alpaca", "max_steps": 100})
    handle.wait(timeout=3600)
    print(handle.losses())
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.service.scheduler.call_waits import SCHEDULER_CALL_WAIT_S
from actors.service.scheduler.config import NAMESPACE, SCHEDULER_NAME, ServiceConfig
from actors.service.table.job_record import parse_cursor
from actors.service.table.job_table import JobRecord
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from actors.spec.sweep_spec import SweepSpec
from orchestrator.client_submissions import as_submission, file_folder, one_job_file, run_submissions
from orchestrator.errors import ServiceError
from orchestrator.job_handle import JobHandle, wait_until_ended
from orchestrator.jobs_file import SpecError, load_run_spec, parse_run_spec
from orchestrator.ray_cluster import _on_head_node, ensure_ray
from orchestrator.scheduler_calls import _call, _init_failure

# what the service's scheduler builds its listeners with: Prometheus metrics and MQTT job events
LISTENERS = "orchestrator.observability:service_listeners"
RESTART_WAIT_S = 90.0   # how long a call waits for a scheduler that is restarting


class Client:
    def __init__(self, scheduler: ray.actor.ActorHandle, *, owned: bool = False):
        self.scheduler = scheduler
        self.owned = owned   # this client started the service and stops it on `shutdown`
        self._tinker: Any = None

    # -- getting a client --------------------------------------------------------------------------------
    @classmethod
    def connect(cls, address: str = "auto", *, name: str = SCHEDULER_NAME) -> Client:
        """Connect to the service running on a Ray cluster (`aspen serve`)."""
        ensure_ray(address)
        try:
            scheduler = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:   # the cluster's own address, where `auto` found it
            where = ray.get_runtime_context().gcs_address if address == "auto" else address
            raise ServiceError(f"no aspen service ('{name}' in namespace '{NAMESPACE}') on the Ray cluster at "
                               f"{where}; start one with `aspen serve`") from None
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
        scheduler = SchedulerActor.options(name=name, namespace=NAMESPACE, **_on_head_node()).remote(
            config, LISTENERS)
        client = cls(scheduler, owned=True)
        if wait_ready:
            try:
                client.wait_ready()
            except BaseException:   # no trainer could start: the service this process started does not stay
                client.shutdown()
                raise
        return client

    @classmethod
    def serve(cls, config: ServiceConfig | dict | None = None, address: str = "auto", *,
              insecure: bool = False) -> Client:
        """Start the long-lived, detached service on a Ray cluster, or connect to it if it runs. Its jobs
        write only under `config.output_root` (default `<state_dir>/outputs`). A new service starts only on a cluster
        that requires Ray's token authentication (else
        `orchestrator.cluster_auth.InsecureClusterError`, a ServiceError) unless `insecure` is true."""
        config = ServiceConfig.model_validate(config or {})
        if config.output_root is None:   # a shared service: jobs write only under its output root
            config = config.model_copy(update={"output_root": Path(config.state_dir).expanduser() / "outputs"})
        ensure_ray(address)
        from orchestrator.cluster_auth import require_token_auth

        try:
            ray.get_actor(SCHEDULER_NAME, namespace=NAMESPACE)   # already running: left alone
        except ValueError:
            require_token_auth(insecure)
        # after the check: the service's modules (torch, transformers) take seconds to import, a refusal none
        from actors.scheduler_actor import SchedulerActor

        scheduler = SchedulerActor.options(name=SCHEDULER_NAME, namespace=NAMESPACE, lifetime="detached",
                                           get_if_exists=True, **_on_head_node()).remote(config, LISTENERS)
        return cls(scheduler)

    def _request(self, method: str, *args: Any, timeout: float | None = SCHEDULER_CALL_WAIT_S) -> Any:
        """Call the scheduler; while it restarts (its process died and Ray brings it back), wait for it and
        ask again (every request is safe to repeat: submissions carry their job ids)."""
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return _call(getattr(self.scheduler, method).remote(*args), timeout=timeout)
            except RayActorError as error:
                if error.actor_init_failed:   # it could not start (e.g. its state dir is in use): say why
                    raise ServiceError(f"the aspen service could not start: {_init_failure(error)}") from None
                if time.monotonic() > deadline:
                    raise ServiceError(f"the aspen service is gone ({type(error).__name__}) and did not come back "
                                       f"within {RESTART_WAIT_S:.0f}s; start it again (`aspen serve`): every job "
                                       "is kept and unfinished ones resume from their checkpoints") from None
                time.sleep(1.0)

    @property
    def tinker(self) -> Any:
        """The Tinker API's calls to this service (orchestrator/tinker/tinker_service.py): what `aspen http`
        serves the `tinker` SDK through (docs/tinker.md)."""
        if self._tinker is None:
            from orchestrator.tinker.tinker_service import TinkerService

            self._tinker = TinkerService(self.scheduler)
        return self._tinker

    def wait_ready(self, timeout: float = 600, nodes_may_join: bool = False) -> dict[str, Any]:
        """The service's info once every trainer has set up, failed to, or is `unplaceable` (no node holds it, none an
        autoscaler may add: its phase says why); TimeoutError after `timeout` s. ServiceError where no trainer runs:
        each failed or waits for a node to join, or none is started (`nodes: each` kinds no node holds: its
        `trainers_error`). With `nodes_may_join` (`aspen serve`: the service stays up), a wait for a node is said in
        the info it returns, not raised: ServiceError only where each trainer failed (docs/cluster.md)."""
        info = self._request("wait_ready", timeout, timeout=timeout + 30)
        live = [t for t in info["trainers"] if not t.get("retired")]   # a retired one never starts again
        failed = [f"{t['id']}: {t['error']}" for t in live if t.get("error")]
        waits = [f"{t['id']}: {t['phase']}" for t in live if t.get("unplaceable") and not t.get("error")]
        if info.get("trainers_error") and not live:   # none started: the kinds no node holds say why
            waits.append(info["trainers_error"])
        runs = any(not t.get("error") and not t.get("unplaceable") for t in live)
        if runs or not (failed or waits) or (nodes_may_join and waits):
            return info
        raise ServiceError("no trainer could start: " + "; ".join(failed + waits))

    def info(self) -> dict[str, Any]:
        return self._request("info")

    def event_settings(self) -> Any:
        """Where and how to subscribe to this service's job events (an `orchestrator.mqtt.settings.EventSettings`):
        its embedded MQTT broker's address and read-only account, read from the service's state dir (so
        this machine must see that folder, and this user read its `mqtt-reader.json`). Raises
        FileNotFoundError / PermissionError saying so (for an external broker: to follow it with the
        service's YAML, `aspen watch --events --config`)."""
        from orchestrator.mqtt.settings import service_settings

        return service_settings(self.info())

    # -- submitting ---------------------------------------------------------------------------------------
    def submit(self, spec: JobSpec | JobSubmission | dict | str | Path, *, base_model: str = "smollm2-135m",
               quantization: str = "none", dtype: str = "auto", seed: int = 0,
               output_dir: str | Path | None = None, check_rows: bool = True) -> JobHandle:
        """Submit one job: a `JobSpec`, a `JobSubmission`, a dict of job fields, or a jobs YAML file with one job
        (use `submit_run` for several), its paths (output_dir too) taken and its refusals worded as `submit_run`
        takes and words them: from the file's folder, at the file's lines. A bad spec raises `SpecError` here, not
        later; so does a data row that does not fit the job's format (its rows read here as the HTTP API reads them:
        orchestrator/row_checks.py; `check_rows=False`: already read)."""
        if isinstance(spec, (str, Path)):   # its paths and refusals as submit_run(spec) takes and words them
            submissions = run_submissions(one_job_file(spec), file_folder(spec), self._output_root)
            return self._submit_many(submissions, check_rows=check_rows, file=spec)[0]
        if isinstance(spec, dict) and "jobs" in spec:
            run = parse_run_spec(spec, source="<dict>", base_dir=Path.cwd(), for_a_service=True)
            if len(run.jobs) != 1:
                raise SpecError(f"<dict>: has {len(run.jobs)} jobs; use submit_run() for several")
            return self.submit_run(run, check_rows=check_rows)[0]
        return self._submit_many([as_submission(spec, base_model=base_model, quantization=quantization,
                                                dtype=dtype, seed=seed, output_dir=output_dir)],
                                 check_rows=check_rows)[0]

    def submit_run(self, run: RunSpec | str | Path, *, check_rows: bool = True) -> list[JobHandle]:
        """Submit every job of a jobs YAML file (or `RunSpec`) in one request, so that they start together
        and share their trainer's steps from the first (where the policy and memory let them); each keeps
        the run's base model and writes to `<output_dir>/<job name>` (a relative output_dir under the service's
        output root, as over HTTP; where the service has none, from the file's folder), or where the file names no
        output_dir, where the service puts a job without one (`<output_root>/<job id>`: a shared service refuses
        folders outside its root). A data row that does not fit its job's format raises `SpecError`, nothing
        entered (`check_rows=False`: the rows were read already)."""
        if isinstance(run, RunSpec):
            return self._submit_many(run_submissions(run, Path.cwd(), self._output_root), check_rows=check_rows)
        submissions = run_submissions(load_run_spec(run, for_a_service=True), file_folder(run), self._output_root)
        return self._submit_many(submissions, check_rows=check_rows, file=run)   # a file: its lines in refusals

    def _output_root(self) -> Any:
        return self.info().get("output_root")

    def submit_records(self, submissions: list[JobSubmission]) -> list[JobRecord]:
        """Enter submissions already validated (`JobSubmission`s), all or none, and return their records (what
        the HTTP API calls: plain data, no handles)."""
        ids = [f"{s.job.name[:56]}-{uuid.uuid4().hex[:6]}" for s in submissions]   # a repeated request finds them
        return self._request("submit_many", list(submissions), ids)

    def check_submissions(self, submissions: list[JobSubmission]) -> None:
        """What `submit_records` would refuse of these submissions (a SubmissionError naming each problem), with
        nothing entered: the HTTP API asks before it reads their rows."""
        self._request("check_submissions", list(submissions))

    def submit_many(self, specs: Iterable[JobSpec | JobSubmission | dict], *, check_rows: bool = True,
                    **run_settings: Any) -> list[JobHandle]:
        """Submit several jobs in one request, all or none: every spec is validated first, and a bad one is
        named (its position and job name) with nothing submitted; so is each job's first data row that does not
        fit its format (`check_rows=False`: the rows were read already). `run_settings` (base_model,
        quantization, dtype, seed) apply to specs that are not `JobSubmission`s."""
        submissions, problems = [], []
        specs = list(specs)
        for index, spec in enumerate(specs):
            try:
                submissions.append(as_submission(spec, **run_settings))
            except (SpecError, ValueError) as error:
                name = spec.get("name") if isinstance(spec, dict) else getattr(getattr(spec, "job", spec), "name", "?")
                problems.append(f"spec {index + 1} of {len(specs)} (job '{name}'): {error}")
        if problems:
            raise SpecError("nothing was submitted:\n" + "\n".join(problems))
        return self._submit_many(submissions, check_rows=check_rows)

    def _submit_many(self, submissions: list[JobSubmission], *, check_rows: bool = True,
                     file: str | Path | None = None) -> list[JobHandle]:
        """Enter the submissions, their rows read first (as the HTTP API reads them) unless `check_rows` is off:
        the service is asked first what it would refuse (who may read the data, its folders), then each job's
        rows, a storage URI's (s3://...) too, with this process's storage credentials as the HTTP API reads them
        with its own (`file`: the jobs file they are from, whose `data` lines a refusal names). A
        `lora.target_modules` name the base has no linear layer of is refused first (`SpecError`), as over HTTP:
        the service entered it, to fail on its trainer once placed."""
        from orchestrator.base_check import check_submission_targets

        check_submission_targets(submissions)
        if check_rows:
            from orchestrator.row_checks import check_submission_rows

            self.check_submissions(submissions)
            check_submission_rows(submissions, file)
        return [JobHandle(self, record.id, record.name) for record in self.submit_records(submissions)]

    # -- sweeps -------------------------------------------------------------------------------------------
    def sweep(self, spec: SweepSpec | dict | str | Path, check_rows: bool = True) -> dict[str, Any]:
        """Start a sweep (docs/sweeps.md): a sweep file's path (paths in it relative to it), a dict of its fields
        (paths relative to this process's folder) or a `SweepSpec`. The service runs it from now on; the answer
        is its status (`sweep_status`). The same sweep submitted again is the same sweep (nothing new starts).
        A data row that does not fit the job's format, under any of the space's values that change how rows read
        (max_seq_len, eval_split, ...), raises `SpecError` naming the space field and value, nothing started
        (`check_rows=False`: the rows were read already; positional too, as the HTTP API's bridge passes it)."""
        from actors.spec.sweep_spec import SweepSpec
        from orchestrator.row_checks import check_sweep_data_rows
        from orchestrator.sweep import load_sweep_spec, sweep_spec_from

        source = str(spec) if isinstance(spec, (str, Path)) else None
        if isinstance(spec, (str, Path)):
            spec = load_sweep_spec(spec)
        elif isinstance(spec, dict):
            spec = sweep_spec_from(spec, source="<sweep>", base_dir=Path.cwd())
        if not isinstance(spec, SweepSpec):
            raise SpecError(f"expected a sweep file, a dict or a SweepSpec, got {type(spec).__name__}")
        # a new sweep: what the service refuses first, then the rows (a storage URI's too, as over HTTP)
        if check_rows and self.check_sweep(spec):
            check_sweep_data_rows(spec, source)
        return self._request("submit_sweep", spec)

    def check_sweep(self, spec: SweepSpec) -> bool:
        """What `sweep` would refuse of a validated sweep (its user's data, its name, its folder), nothing started:
        the HTTP API asks before it reads the sweep's rows. True where it would start a new sweep."""
        return self._request("check_sweep", spec)

    def sweep_status(self, name: str) -> dict[str, Any]:
        """`{"name", "state" (running, done, cancelled, failed), "error", "trials": [{"name", "settings", "state",
        "objective", "steps", "stopped_because", "continued_from"}], "best", ...}`; KeyError for an unknown sweep. A
        trial whose job was extended or resumed after it ended is `continued` (from step `continued_from`) while it
        trains again, then ranks by the objective it ends with."""
        return self._request("sweep", name)

    def sweeps(self) -> list[dict[str, Any]]:
        return self._request("sweeps_list")

    def accounts(self) -> list[dict[str, Any]]:
        """Each user's jobs and what they used: `{"user", "jobs", "tokens", "step_seconds", "gpu_seconds"}` (user
        None: jobs submitted through Ray)."""
        return self._request("accounts")

    def cancel_sweep(self, name: str) -> dict[str, Any]:
        """Start no more trials of the sweep and cancel its running ones."""
        return self._request("cancel_sweep", name)

    # -- following ----------------------------------------------------------------------------------------
    def jobs(self, states: Iterable[str] | None = None, limit: int | None = None, after: str | None = None,
             owner: str | None = None) -> list[JobRecord]:
        """Every job, oldest first (or those in `states`, or `owner`'s only); a page of them: at most `limit`, after
        the cursor `after` (`page_cursor(record)` of the last job of the page before)."""
        cursor = parse_cursor(after) if after is not None else None
        return self._request("jobs", tuple(states) if states else None, limit, cursor, owner)

    def status(self, job: str) -> JobRecord:
        return self._request("status", job)

    def handle(self, job: str) -> JobHandle:
        record = self.status(job)
        return JobHandle(self, record.id, record.name)

    def submission(self, job: str) -> JobSubmission:
        """The job's submission as the service stored it."""
        return self._request("submission", job)

    def losses(self, job: str) -> list[dict[str, Any]]:
        return self._request("progress", job)

    def transitions(self, job: str) -> list[tuple[float, str, str]]:
        return self._request("transitions", job)

    def transitions_after(self, after: int | None, limit: int = 1000) -> tuple[int, list[dict[str, Any]]]:
        """Every job's state transitions after the one numbered `after` (None: none), oldest first, and the
        newest one's number: to follow the whole job table without gaps (`JobTable.transitions_after`)."""
        return self._request("transitions_after", after, limit)

    def trainers(self) -> list[dict[str, Any]]:
        return self._request("trainers")

    def cancel(self, job: str) -> JobRecord:
        return self._request("cancel", job)

    def pause(self, job: str) -> JobRecord:
        return self._request("pause", job)

    def resume(self, job: str, reason: str = "resumed by the user") -> JobRecord:
        """Queue a paused, failed or cancelled job again: it resumes from its last checkpoint."""
        return self._request("resume", job, reason)

    def extend(self, job: str, submission: JobSubmission, reason: str = "its budget raised") -> JobRecord:
        """Raise an ended or paused job's max_steps, epochs or both (`submission`: its spec with only those raised) and
        queue it again: it continues from its last checkpoint to the new budget."""
        return self._request("extend", job, submission, reason)

    def raise_max_steps(self, job: str, max_steps: int) -> JobRecord:
        """`raise_budget` with `max_steps` alone."""
        return self.raise_budget(job, max_steps=max_steps)

    def raise_budget(self, job: str, max_steps: int | None = None, epochs: float | None = None) -> JobRecord:
        """Continue an ended or paused job to `max_steps`, `epochs` or both (each above its own; one its epochs ended
        trains on into its next epoch): it is queued again and trains on from its last checkpoint, as `aspen run`
        again with the raised budget does (`extend`); a job its early_stop rule ended continues without that rule."""
        submission, state = self.submission(job), self.status(job).state
        budget = (("max_steps", max_steps), ("epochs", None if epochs is None else float(epochs)))
        change: dict[str, Any] = {name: value for name, value in budget if value is not None}
        reason = " and ".join(f"{name} raised to {value:g}" for name, value in change.items())
        if state == "stopped_early" and submission.job.early_stop is not None:   # it would end it again at once
            change["early_stop"] = None
            reason += " without the early_stop rule that ended it"
        raised = submission.model_copy(update={"job": submission.job.model_copy(update=change)})
        return self.extend(job, raised, reason)

    def generate(self, job: str, prompt: str, max_new_tokens: int = 64, ticket: str | None = None) -> dict[str, Any]:
        """"Try it": `prompt` continued greedily by the job's adapter and by the base alone, on a trainer between two
        steps: a running job's current adapter (on its trainer), a completed or early-stopped job's final one (on a
        trainer holding its base): `{"job", "step", "prompt", "adapter", "base", "prompt_tokens", "new_tokens",
        "seconds"}`. ValueError for a job with neither (queued, paused, failed, cancelled). `ticket`: a fresh unique
        string of the caller's, by which another thread may withdraw the call (`withdraw_try`)."""
        return self._request("generate", job, prompt, max_new_tokens, ticket)

    def withdraw_try(self, ticket: str) -> bool:
        """Withdraw the "try it" sent with `ticket` (its caller stopped waiting): it is not run, or its generation
        stops at the trainer's next look, and its `generate` call raises ValueError at once. Whether a call held it
        (False: none yet, and the one that comes with it is refused; or it was answered already)."""
        return self._request("withdraw_try", ticket)

    def export(self, job: str, out: str | Path | None = None, *, merge: bool = False, force: bool = False,
               checkpoint: bool = False, base: str | None = None, dtype: str = "auto") -> Path:
        """Write the job's final adapter as a PEFT folder (vLLM's --lora-modules), or with `merge` the base with
        it merged as a transformers folder; returns the folder (`aspen export`, orchestrator/export.py). The
        job's output folder must be reachable from here (a shared mount or a storage URI)."""
        from orchestrator.export import export_job

        return export_job(job, out, merge=merge, force=force, checkpoint=checkpoint, base=base, dtype=dtype,
                          service=self.status)

    def generations(self, job: str, step: int | None = None) -> dict[str, Any]:
        """An eval_generate evaluation of the job (the last, or the one after `step`): {steps, step, rows}, each
        row its prompt, reference, the adapter's prediction and score, read from the job's generations.jsonl (its
        output folder must be reachable from here: this machine, a shared mount or a storage URI). ValueError
        for a step that was not evaluated."""
        from actors.service.outputs.job_files import job_generations

        return job_generations(self.status(job), step)

    def delete(self, job: str) -> None:
        """Forget a job that is not running (its files stay, and a new job is not given them to overwrite: its
        folder is refused to a submission while they are there)."""
        self._request("delete", job)

    def wait(self, job: str, timeout: float | None = None, poll: float = 0.5) -> JobRecord:
        """Block until the job has ended (completed, stopped early, failed or cancelled)."""
        return wait_until_ended(self.status, job, timeout, poll)

    def wait_all(self, jobs: Iterable[str], timeout: float | None = None, poll: float = 0.5) -> list[JobRecord]:
        deadline = None if timeout is None else time.time() + timeout
        return [self.wait(job, None if deadline is None else max(deadline - time.time(), 0), poll) for job in jobs]

    def shutdown(self, hold: bool | str = False) -> None:
        """Stop the service: running jobs are checkpointed (and resume when it starts again); with `hold` (`aspen
        run`'s own service) they and the queued ones are recorded paused, saying that the same command continues
        them, as `aspen run --in-process` records them (a str: what continues them, `aspen sweep`'s, `aspen demo`'s)."""
        try:
            _call(self.scheduler.shutdown.remote(hold), timeout=300)
        except RayActorError as error:
            if not error.actor_init_failed:
                raise
            # it never started (a damaged job table, its state dir in use): nothing to stop, and the reason
            # was raised by the call that met it (`aspen run` calls this in a `finally`)
        finally:
            ray.kill(self.scheduler)
