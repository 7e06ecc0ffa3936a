"""The service in this process, without Ray (`aspen run --in-process`, tests, benchmarks): the same
scheduler core, policy and memory admission, trainer loop, job data, stop rules, evaluations and
checkpoints as `aspen run`, with direct calls where the service has Ray's. A run spec gives the same
steps, stop steps, evaluations and adapters in both modes (`tests/service/test_one_path.py`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.engine.models import BaseModel, load_base_model
from actors.engine.step_report import StepReport
from actors.service.outputs.job_files import clear_job_folder
from actors.service.pipeline.pipeline_engine import PipelineEngine, start_pipeline
from actors.service.scheduler.config import StorageConfig, TrainerConfig, run_service_config
from actors.service.scheduler.held_jobs import HeldJobs, give_back_unheld
from actors.service.scheduler.job_data import JobData
from actors.service.scheduler.policy_composer import HeldComposer
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import TERMINAL_STATES, JobRecord, JobTable
from actors.service.table.recorded_run import CarriedJobs, carry_on, record_run, stopped_run_reason
from actors.service.table.state_dir import StateDirInUse, lock_state_dir, release_state_dir
from actors.service.trainer.job_link import Assignment, LocalJobLink
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.job_submission import canonical_base_model
from actors.spec.run_spec import RunSpec
from actors.storage.s3_settings import configured_storage, storage_configured
from actors.storage.storage_uri import StorageURI, as_location
from policies.base import Preempt, Start, StepComposer
from policies.registry import load_policy

log = logging.getLogger(__name__)

TRAINER_ID = "in-process"
IDLE_ROUNDS = 50   # rounds in a row without a step or a change before a run that cannot go on says why
UPLOAD_WAIT_S = 0.05   # a round's wait while the only work left is jobs' uploads (a wake-up ends it early)


@dataclass(kw_only=True)
class JobSummary:
    name: str
    state: str
    steps: int
    tokens: int
    first_loss: float | None
    final_loss: float | None
    eval_loss: float | None
    adapter_dir: Path | StorageURI | None   # a storage URI where the run's output_dir is one
    eval_score: float | None = None   # the last evaluation's eval_generate score, where the job has one
    reason: str
    evals: list[tuple[int, float]]   # (step, eval loss) of each evaluation
    record: JobRecord                # its row of the run's job table as the run ended (`aspen run` prints these)


class StopBetweenSteps:
    """A stop asked for (Ctrl-C, SIGTERM: `request` from the signal handler) while the run's steps go, held until the
    round that runs has ended: the jobs are then checkpointed between two steps, as a service's trainer stops them.
    Raised where the signal came (inside a step, between a job's optimizer update and the rest of its step's
    bookkeeping), the jobs were checkpointed half updated, and a run resumed from those checkpoints did not end as
    the run undisturbed. Before the steps start (the base loading, the data read) a request is raised at once."""

    def __init__(self) -> None:
        self.pending: BaseException | None = None
        self.stepping = False
        self.began = False   # whether steps ran (a stop before them leaves no job to checkpoint)

    def request(self, error: BaseException) -> None:
        """Hold `error` until the running round ends (the first one asked for), or raise it now where no step runs."""
        if not self.stepping:
            raise error
        self.pending = self.pending or error

    def check(self) -> None:
        """Between rounds: raise the stop asked for, if any."""
        if self.pending is not None:
            error, self.pending = self.pending, None
            raise error

    @contextlib.contextmanager
    def holding_ctrl_c(self) -> Iterator[None]:
        """Steps running: Ctrl-C held through `request` where Python's own handler would raise it (the main thread,
        no handler of the caller's: a notebook's or a script's Ctrl-C in `train_locally`), the handler put back
        after."""
        self.stepping = self.began = True
        own = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if own:
            signal.signal(signal.SIGINT, lambda signum, frame: self.request(KeyboardInterrupt()))
        try:
            yield
        finally:
            self.stepping = False
            if own:
                signal.signal(signal.SIGINT, signal.default_int_handler)


class RunStuck(RuntimeError):
    """Jobs that can never start in this process (e.g. beyond the memory budget): the reasons."""


def train_locally(spec: RunSpec, *, base: BaseModel | None = None, progress: bool = True,
                  on_step: Callable[[StepReport], None] | None = None,
                  trainer: dict | None = None, storage: StorageConfig | dict | None = None,
                  loader: Callable[[], BaseModel] | None = None, record_in: Path | None = None,
                  stops: StopBetweenSteps | None = None, carry: CarriedJobs | None = None,
                  policy_said: Callable[[dict], None] | None = None) -> list[JobSummary]:
    """Run every job of `spec` to its end in this process; one summary per job, in the file's order. Job
    ids are the job names; each job writes to `<output_dir>/<name>` as under `aspen run`. Every job starts
    over (what an earlier run left in its folder, a checkpoint, an adapter, metrics, is deleted first) but those
    `carry` names: jobs of `record_in`'s table, by their ids there, that `aspen run`'s plan
    (`orchestrator.run_plan`) left alone or resumes from their checkpoints; they keep their ids. `trainer`:
    further TrainerConfig fields (e.g. `{"recompute": "layers"}`), as `run_service_config` takes them.
    `storage`: the service's `storage:` settings (S3 endpoint, region, credential variables), used in this
    process for the run (the environment's where it gives none). With `stages: N` the stages run as processes
    of this one (actors/service/pipeline/pipeline_engine.py), each loading its share of the base (`loader`: a picklable
    callable returning the whole base instead, which each stage process then cuts). `record_in`: the run's state
    folder (`aspen run --in-process`: `<output_dir>/.aspen`), locked for the run as a service locks it (where one
    runs on it, `StateDirInUse` before anything is deleted or loaded), and where the run's jobs are recorded as they
    start and as it ends, also when it is interrupted (`recorded_run.record_run`). `stops`: where a signal handler's
    stop requests are held until the round that runs has ended (`StopBetweenSteps`). `policy_said`: given the policy's
    part of a service's info at the run's end (`policy_error` where FIFO replaced it, `policy_warnings`)."""
    if carry is not None and record_in is None:
        raise ValueError("train_locally: `carry` names jobs of a run folder's table; give that folder (`record_in`)")
    with contextlib.nullcontext() if record_in is None else held_run_folder(record_in):
        return _train(spec, base, progress, on_step, trainer, storage, loader, record_in,
                      stops or StopBetweenSteps(), carry or CarriedJobs(), policy_said or (lambda info: None))


_HELD: dict[Path, int] = {}   # the run folders this process holds (`held_run_folder`): the holding thread's id


@contextlib.contextmanager
def held_run_folder(state_dir: Path) -> Iterator[None]:
    """The run's state folder locked for this process while the block runs (`lock_run_folder`); where this thread
    holds it already (a command that planned the run under the lock, then trains it), held on. Another thread of
    this process is refused it as another process is."""
    key = state_dir.resolve()
    if _HELD.get(key) == threading.get_ident():
        yield
        return
    made, folder = [], key   # the folders its lock makes, outermost first: removed again if the run records nothing
    while not folder.exists():
        made, folder = [folder, *made], folder.parent
    handle = lock_run_folder(state_dir)
    _HELD[key] = threading.get_ident()
    try:
        yield
    finally:
        del _HELD[key]
        release_state_dir(handle, key, made)


def lock_run_folder(state_dir: Path) -> IO:
    """The run's state folder locked for this process, as a service locks its own (`lock_state_dir`)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        return lock_state_dir(state_dir)
    except StateDirInUse as error:
        raise StateDirInUse(f"another aspen run or service is writing to {state_dir.parent} ({error.holder}): "
                            "nothing was changed there; wait for it to end or stop it (`aspen stop`), or give this "
                            "run another output folder (--output-dir)", error.holder) from None


def _train(spec: RunSpec, base: BaseModel | None, progress: bool, on_step: Callable[[StepReport], None] | None,
           trainer: dict | None, storage: StorageConfig | dict | None, loader: Callable[[], BaseModel] | None,
           record_in: Path | None, stops: StopBetweenSteps, carry: CarriedJobs,
           policy_said: Callable[[dict], None]) -> list[JobSummary]:
    policy = load_policy(spec.policy)   # before the model loads: a policy that cannot be loaded says so at once
    if base is None and spec.stages == 1:   # named as the trainer's config and the jobs name it (a local path absolute)
        base = load_base_model(canonical_base_model(spec.base_model), dtype=spec.dtype, device=spec.device,
                               quantization=spec.quantization, kernels=spec.kernels)
    storage_config = StorageConfig.model_validate(storage) if isinstance(storage, dict) else storage
    with tempfile.TemporaryDirectory(prefix="aspen-in-process-") as state, \
            storage_configured(storage_config.settings() if storage_config else configured_storage()):
        config = run_service_config(spec, state_dir=Path(state), trainer=trainer or {},
                                    **({"storage": storage_config} if storage_config else {}))
        trainer_config = config.trainers[0]
        table = JobTable(Path(state) / "jobs.sqlite")
        core = SchedulerCore(table, policy, Path(state), trainers=[trainer_config],
                             policy_timeout_s=config.policy_timeout_s)
        loop = TrainerLoop(base, trainer_config, TRAINER_ID, Path(state),
                           HeldComposer(policy, core.guard.clock, core.guard.warn)
                           if isinstance(policy, StepComposer) else None,
                           engine=_pipeline(trainer_config, loader) if trainer_config.stages > 1 else None)
        base = loop.base
        if record_in is not None:
            carry_on(record_in / "jobs.sqlite", table, carry, "resumed by aspen run --in-process")
            for job_id, submission in carry.extend.items():
                core.extend(job_id, submission, "its budget raised by aspen run --in-process")
        carried = {table.get(job_id).name: job_id for job_id in (*carry.done, *carry.resume, *carry.extend)}
        submissions = [s for s in spec.submissions() if s.job.name not in carried]
        # every job submitted starts over, its folder cleared below (`aspen run --in-process` refused a folder holding
        # another run's outputs before it came here, where --overwrite did not say to delete them)
        core.submit_many(submissions, job_ids=[submission.job.name for submission in submissions], starts_over=True)
        ids = [carried.get(job.name, job.name) for job in spec.jobs]
        # recorded before their folders are cleared: a run killed on the way leaves no earlier run's record of them
        # (a job done there) in the table; where the table refuses (said once), not again at the end
        record_in = record_in if record_in is not None and _record(table, ids, record_in / "jobs.sqlite") else None
        for submission in submissions:
            clear_job_folder(submission.output_dir)
        bar = _step_bar(progress)
        steps = bar.add_task(f"{len(ids)} jobs on {spec.base_model}",
                             total=sum(job.max_steps or 0 for job in spec.jobs) or None,
                             completed=sum(table.get(job_id).step for job_id in carried.values()))
        bar.start()
        try:
            with stops.holding_ctrl_c():
                _run(core, loop, table, base, ids, lambda done: bar.advance(steps, done), on_step, stops)
        finally:
            bar.stop()
            try:
                loop.close()   # running jobs are checkpointed and paused (a pipeline's stages stopped)
            finally:   # their events booked as the service books them, also where the close failed
                summaries = _book_the_end(core, loop, table, ids, record_in)
    policy_said(core.guard.describe())   # FIFO replaced the run's policy: said as `aspen run` says it
    return summaries


def _book_the_end(core: SchedulerCore, loop: TrainerLoop, table: JobTable, ids: list[str],
                  record_in: Path | None) -> list[JobSummary]:
    """The trainer's last events booked, the jobs' summaries, the run recorded where `record_in` says; the run's own
    table closed."""
    try:
        with table.transaction():
            for event in loop.drain_events():
                core.apply_event(TRAINER_ID, event)
        summaries = [_summary(table.get(job_id), table) for job_id in ids]
        if record_in is not None:   # its unfinished jobs paused, as `aspen run`'s service holds them as it stops
            _record(table, ids, record_in / "jobs.sqlite", stopped_run_reason)
    finally:
        table.close()
    return summaries


def _record(table: JobTable, ids: list[str], path: Path,
            unfinished: Callable[[JobRecord], str] | None = None) -> bool:
    """The run's jobs recorded in the run folder's table (True); where that fails, a warning that says what it means
    (the run's own outcome, or the error that ended it, is what the command reports)."""
    try:
        record_run(table, ids, path, unfinished)
    except Exception as error:  # noqa: BLE001 - the jobs' folders hold what they trained; only the record is lost
        log.warning("the run's jobs could not be recorded in %s (%s: %s): their folders will hold what they train, "
                    "but `aspen status` and `aspen report` will not show their states", path, type(error).__name__,
                    error)
        return False
    return True


def _pipeline(config: TrainerConfig, loader: Callable[[], BaseModel] | None) -> PipelineEngine:
    """The run's pipeline stages as local processes: on CPU, the cores shared among them (or `threads` each)."""
    threads = config.threads or (None if config.num_gpus else max(1, (os.cpu_count() or 1) // config.stages))
    return start_pipeline(config, loader, threads=threads)


def _step_bar(enabled: bool) -> Progress:
    """The run's progress on stderr: optimizer steps of all its jobs together (of the sum of their max_steps,
    where every job gives one), drawn by rich as the CLI draws its tables and `aspen watch`."""
    columns = [TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
               TimeElapsedColumn()]
    return Progress(*columns, console=Console(stderr=True), disable=not enabled)


def _run(core: SchedulerCore, loop: TrainerLoop, table: JobTable, base: BaseModel, ids: list[str],
         advance: Callable[[int], None], on_step: Callable[[StepReport], None] | None,
         stops: StopBetweenSteps) -> None:
    """What the scheduler actor's tick and the trainer actor's loop do, in turn, until every job ended (or a stop
    was asked for: raised between two rounds)."""
    idle, held = 0, HeldJobs()
    while True:
        stops.check()
        status = loop.status()   # after the last events were booked, as the service reads a trainer's answer
        give_back_unheld(held, core.booking, [status], lambda job_id: False)
        with table.transaction():
            actions = core.plan([status])
        starts = []
        for action in actions:
            if isinstance(action, Start):
                try:
                    starts.append(_assignment(table, action.job, base))
                except Exception as error:  # noqa: BLE001 - a job whose data cannot be read fails alone, as in the service
                    with table.transaction():
                        core.start_failed(action.job, f"its data could not be read: {error}")
        if starts:
            loop.assign(starts)   # started together, as the service starts a group
        for action in actions:
            if isinstance(action, Preempt):
                loop.stop_job(action.job, "paused", action.reason)
        report = loop.run_once(idle_wait=UPLOAD_WAIT_S if loop.leaving and not loop.active else 0)
        events = loop.drain_events()
        with table.transaction():
            for event in events:
                core.apply_event(TRAINER_ID, event)
        if report is not None:
            advance(sum(1 for r in report.results if r.optimizer_step is not None))
            if on_step is not None:
                on_step(report)
        unfinished = [r for r in (table.get(job_id) for job_id in ids) if r.state not in TERMINAL_STATES]
        if not unfinished:
            return
        idle = 0 if (report is not None or events or starts) else idle + 1
        if idle >= IDLE_ROUNDS and not loop.active and not loop.leaving:
            raise RunStuck("; ".join(f"job {r.name} {r.state}: {r.reason}" for r in unfinished))


def _assignment(table: JobTable, job_id: str, base: BaseModel) -> Assignment:
    submission = table.submission(job_id)
    data = JobData(job_id, submission, base.tokenizer)
    summary = data.prepare()
    return Assignment(job_id=job_id, submission=submission, output_dir=as_location(submission.output_dir),
                      data=summary, eval_examples=data.eval_examples(), link=LocalJobLink(data))


def _summary(record: JobRecord, table: JobTable) -> JobSummary:
    rows = table.progress.of_job(record.id)
    losses = [row["loss"] for row in rows if row.get("loss") is not None]
    evals = [(row["step"], row["eval_loss"]) for row in rows if row.get("eval_loss") is not None]
    scores = [row["eval_score"] for row in rows if row.get("eval_score") is not None]
    return JobSummary(name=record.name, state=record.state, steps=record.step, tokens=record.tokens,
                      first_loss=losses[0] if losses else None, final_loss=losses[-1] if losses else None,
                      eval_loss=record.eval_loss,
                      adapter_dir=as_location(record.adapter_dir) if record.adapter_dir else None,
                      reason=record.reason, evals=evals, eval_score=scores[-1] if scores else None, record=record)
