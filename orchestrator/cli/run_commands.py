"""`aspen run`: a run by a service of its own (or in process), waited for; re-runnable (a plan against the job
table); SIGTERM and Ctrl-C checkpoint the running jobs. `aspen sweep`: orchestrator/cli/sweep_commands.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from actors.storage.storage_uri import as_location, resolve_location
from orchestrator.base_check import check_base_exists, check_device, check_stage_split, check_target_modules
from orchestrator.jobs_file import check_data_rows, load_run_spec
from orchestrator.run_folders import check_job_folders, check_output_dir

if TYPE_CHECKING:
    from actors.service.scheduler.local_run import StopBetweenSteps
    from actors.service.table.job_table import JobRecord
    from actors.spec.run_spec import RunSpec
    from orchestrator.run_plan import RunPlan


def cmd_run(args: argparse.Namespace) -> int:
    """Train a jobs file through a service of its own. Run again on the same output folder, it resumes the
    unfinished jobs from their checkpoints and leaves finished ones alone (`orchestrator.run_plan`)."""
    spec = load_run_spec(args.file)
    if args.output_dir:
        spec = spec.model_copy(update={"output_dir": resolve_location(args.output_dir)})
    check_output_dir(spec, args.file, overridden=bool(args.output_dir))
    check_job_folders(spec, args.file)   # a file where a job's folder goes: said before its trainer fails on it
    check_base_exists(spec, args.file)   # before an earlier run's jobs are compared with the file's
    check_target_modules(spec, args.file)   # from the base's config: no trainer started for names it lacks
    check_device(spec, args.file, in_process=args.in_process)   # a GPU this machine has not
    check_stage_split(spec, args.file)   # against the base's layers: before its trainer starts
    if args.in_process:
        return _run_in_process(spec, args.file, args.quiet, args.overwrite)
    from actors.service.outputs.earlier_outputs import earlier_outputs
    from actors.service.outputs.job_files import clear_job_folder
    from actors.service.scheduler.config import run_local_dir, run_service_config
    from actors.service.table.job_table import read_jobs
    from orchestrator.run_plan import plan_run

    output_dir = resolve_location(spec.output_dir)
    spec = spec.model_copy(update={"output_dir": output_dir})
    # The plan needs only the job table. Read without a service first: a run whose jobs are all done, or whose
    # spec or data changed, answers at once, with no Ray started; else the service's own table is asked (it
    # may have been changed since, by a run that was still ending), and the trainers (a model load each) are
    # waited for only where there is something to train.
    table = run_local_dir(spec) / ".aspen" / "jobs.sqlite"
    earlier = read_jobs(table)
    data_checked: set[str] = set()   # folders of jobs whose data matched their checkpoint in the first plan
    # no table: every job is new, and none may train over outputs found in its folder (a table not read here, a killed
    # service's, is read by the service: the plan below, against its jobs, refuses them then)
    if earlier is None and not table.exists():
        refuse_foreign_outputs(output_dir, plan_run(spec.submissions(), [], {}.__getitem__,
                                                    found_outputs=earlier_outputs), [], args.overwrite, say=False)
    elif earlier is not None:
        submissions = {record.id: submission for record, submission in earlier}
        plan = plan_run(spec.submissions(), [record for record, _ in earlier], submissions.__getitem__,
                        saved_data=saved_data_digest, saved_step=saved_step, found_outputs=earlier_outputs)
        refuse_restarts(output_dir, plan, args.overwrite)
        refuse_foreign_outputs(output_dir, plan, [record for record, _ in earlier], args.overwrite, say=False)
        if not (plan.submit or plan.resume or plan.started_over or plan.extend):
            for line in plan.lines(saved_step=saved_step):
                print(line)
            return _run_summary(spec, output_dir, plan.done)
        data_checked = {record.output_dir for record in (*plan.resume, *plan.done, *(r for r, _ in plan.extend))}
    # the rows of every job about to train, before anything starts (a bad row fails here, not minutes later)
    check_data_rows(spec, None if earlier is None else {s.job.name for s in plan.submit} | {
        r.name for r in (*plan.resume, *plan.started_over, *(r for r, _ in plan.extend))}, file=args.file)
    from orchestrator.client import Client
    from orchestrator.progress import follow_jobs, wait_for_trainers, warn_policy_replaced

    # jobs left unfinished by an earlier run are held (paused) until this run's plan says what to do
    config = run_service_config(spec, resume_on_start=False)
    client = Client.local(config, address=os.environ.get("RAY_ADDRESS"), wait_ready=False)
    _terminate_as_interrupt()
    from orchestrator.recent_runs import RecentRuns

    RecentRuns().remember(args.file, str(output_dir), config.state_dir)   # `aspen status` after it ends
    try:
        # each job's data is read for its digest once per run: not again for the jobs the first plan checked
        plan = plan_run(spec.submissions(), client.jobs(), lambda job: client.submission(job),
                        saved_data=lambda folder: None if folder in data_checked else saved_data_digest(folder),
                        saved_step=saved_step, found_outputs=earlier_outputs)
        refuse_restarts(output_dir, plan, args.overwrite)
        refuse_foreign_outputs(output_dir, plan, client.jobs(), args.overwrite)
        for _, found in plan.foreign:   # --overwrite: deleted, as the service refuses a folder holding them
            clear_job_folder(found.folder)
        # only the jobs whose spec or data changed start over: unchanged ones resume or stay as they are
        restarted = [*plan.started_over, *(record for record, _ in plan.retry)]
        for record in restarted:
            client.delete(record.id)
            clear_job_folder(as_location(record.output_dir))
        for line in plan.started_over_lines("were"):
            print(line)
        if restarted:
            plan = plan_run(spec.submissions(), client.jobs(), lambda job: client.submission(job),
                            saved_step=saved_step)
        for line in plan.lines(saved_step=saved_step):
            print(line)
        if plan.resume or plan.submit or plan.extend:
            wait_for_trainers(client, quiet=args.quiet)
        for record in plan.resume:
            client.resume(record.id, "resumed by aspen run")
        for record, submission in plan.extend:
            client.extend(record.id, submission, "its budget raised by aspen run")
        ids = {r.id for r in (*plan.resume, *plan.done, *(r for r, _ in plan.extend))}
        # their rows were read before the service started (check_data_rows above)
        ids |= {h.id for h in client.submit_many(plan.submit, check_rows=False)} if plan.submit else set()
        with checkpointing_on_interrupt("jobs"):
            records = follow_jobs(lambda: [r for r in client.jobs() if r.id in ids], quiet=args.quiet)
            warn_policy_replaced(client.info())
    finally:   # jobs left unfinished held paused, saying the same command continues them (as --in-process does)
        client.shutdown(hold=True)
    return _run_summary(spec, output_dir, records)


def _run_summary(spec: RunSpec, output_dir: Path | str, records: list[JobRecord]) -> int:
    """The end of `aspen run`: the jobs' table, where their files are, a line per job that did not finish;
    the exit status (1 where one did not)."""
    from orchestrator.progress import print_table, summary_table

    print_table(summary_table(records, title=f"{len(records)} jobs on {spec.base_model}"))
    print(f"adapters and metrics in {output_dir}")
    failed = [r for r in records if r.state not in ("completed", "stopped_early")]
    for record in failed:
        print(f"aspen: job {record.name} {record.state}: {record.reason}", file=sys.stderr)
    return 1 if failed else 0


class RunSpecChanged(ValueError):
    """`aspen run` again with a jobs file whose jobs differ from the earlier run's (exit 2)."""


class CheckpointGone(ValueError):
    """`aspen run` again that would continue a job from a checkpoint no longer in its folder (exit 2)."""


def refuse_restarts(output_dir: Path | str, plan: RunPlan, overwrite: bool) -> None:
    """Without --overwrite: RunSpecChanged where jobs' spec or data changed, CheckpointGone where the checkpoints
    jobs would continue from are gone; each names the jobs and the ways on."""
    from orchestrator.run_plan import changed_message, lost_message

    if plan.changed and not overwrite:
        raise RunSpecChanged(changed_message(Path(str(output_dir)), plan.changed))
    if plan.lost and not overwrite:
        raise CheckpointGone(lost_message(output_dir, plan.lost))


class ForeignOutputs(ValueError):
    """`aspen run` whose new jobs' folders hold outputs its job table has no record of there (exit 2)."""


def refuse_foreign_outputs(output_dir: Path | str, plan: RunPlan, records: list[JobRecord], overwrite: bool, *,
                           say: bool = True) -> None:
    """ForeignOutputs where new jobs of the plan would train over outputs found in their folders (a copied or moved
    folder, a deleted table), unless --overwrite: then (with `say`) one line each says that they are deleted (the
    caller deletes them, or `train_locally` does as it starts the jobs)."""
    from orchestrator.run_plan import foreign_message

    if plan.foreign and not overwrite:
        raise ForeignOutputs(foreign_message(output_dir, plan.foreign, records))
    for name, found in plan.foreign if say else ():
        print(f"{name}: started over (--overwrite): {found.folder} held outputs its table has no record of "
              f"({found.describe()}); they are deleted")


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during `aspen run`: the running jobs were checkpointed. `then`: what continues them."""

    def __init__(self, terminated: bool = False,
                 then: str = "the same command continues where they stopped"):
        super().__init__()
        self.terminated, self.then = terminated, then


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job system's stop) while a command that started a service of its own runs."""


@contextmanager
def checkpointing_on_interrupt(what: str, then: str | None = None) -> Iterator[None]:
    """Ctrl-C or SIGTERM inside: one line says the running `what` (jobs, trials) are being checkpointed, and
    `RunInterrupted` carries `then` (what continues them) to the line said once the service has shut down."""
    try:
        yield
    except KeyboardInterrupt as interrupt:
        terminated = isinstance(interrupt, Terminated)
        print(f"aspen: {'stopped (SIGTERM)' if terminated else 'interrupted'}; checkpointing the running {what} ...",
              file=sys.stderr, flush=True)
        raise (RunInterrupted(terminated) if then is None else RunInterrupted(terminated, then)) from None


def _terminate_as_interrupt() -> None:
    """Make SIGTERM stop this command as Ctrl-C does (the running jobs checkpointed, the service shut down, one
    line said), in place of Ray's handler, which the service's start installed and which prints a C++ stack
    and leaves the jobs to their last checkpoint. Called after `ray.init`, in the main thread."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, stop)


def _stop_between_steps() -> StopBetweenSteps:
    """Ctrl-C and SIGTERM for a run in this process: once its steps go, held until the step that runs has ended
    (one line says so), then raised as KeyboardInterrupt / Terminated; before that, raised at once. Asked again
    while held, the process ends at once (exit 130 / 143), its jobs left their last checkpoints."""
    import signal

    from actors.service.scheduler.local_run import StopBetweenSteps

    stops = StopBetweenSteps()

    def stop(signum: int, frame: object) -> None:
        stops.request(Terminated() if signum == signal.SIGTERM else KeyboardInterrupt())

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    _watch_stops(stops)
    return stops


def _watch_stops(stops: StopBetweenSteps) -> None:
    """What the user sees at once of a Ctrl-C or SIGTERM while steps run: a line saying the run stops once the
    step that runs has ended; at a second one the process ends at once (exit 130 / 143), the jobs left their last
    checkpoints (written between steps): for a step that takes long, or never ends. Python runs signal handlers
    in the main thread between bytecodes, so not while it waits in a C call (a pipeline stage's receive, one long
    product); the kernel's signal still writes its number to the wakeup fd, which a thread of its own reads."""
    import signal
    import threading

    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch() -> None:
        seen = 0
        while True:
            number = os.read(read, 1)
            if not number or number[0] not in (signal.SIGINT, signal.SIGTERM):
                continue
            seen += 1
            # `began`, not `stepping`: the main thread may have raised the stop at the top of its next round and left
            # the steps (to checkpoint the jobs) before this thread read the signal; the line holds either way
            if seen == 1 and stops.began:
                print("aspen: stopping once the step that runs has ended; the jobs are checkpointed then (Ctrl-C "
                      "again: at once)", file=sys.stderr, flush=True)
            elif seen >= 2:
                print("aspen: stopped at once; the jobs keep their last checkpoints (the same command resumes "
                      "them)", file=sys.stderr, flush=True)
                os._exit(143 if number[0] == signal.SIGTERM else 130)

    threading.Thread(target=watch, name="aspen-second-stop", daemon=True).start()


def saved_step(output_dir: str) -> int | None:
    """The step of the job's checkpoint: the one uploaded to a storage URI (its pointer), or on disk."""
    from actors.checkpoint import saved_step
    from actors.service.outputs.job_files import CHECKPOINT_FOLDER
    from actors.storage.checkpoint_mirror import read_pointer
    from actors.storage.storage_location import StorageLocation
    from actors.storage.storage_uri import is_uri

    if is_uri(output_dir):
        pointer = read_pointer(StorageLocation(output_dir))
        return None if pointer is None else pointer["step"]
    return saved_step(Path(output_dir) / CHECKPOINT_FOLDER)


def saved_data_digest(output_dir: str) -> tuple[int, str | None] | None:
    """The step and data digest of the job's checkpoint (the one uploaded to a storage URI, or on disk)."""
    from actors.checkpoint import STATE_NAME, saved_data_digest
    from actors.service.outputs.job_files import CHECKPOINT_FOLDER
    from actors.storage.checkpoint_mirror import read_pointer
    from actors.storage.storage_location import StorageLocation
    from actors.storage.storage_uri import is_uri

    if is_uri(output_dir):
        location = StorageLocation(output_dir)
        pointer = read_pointer(location)
        if pointer is None:
            return None
        try:
            state = json.loads(location.read_bytes(f"{pointer['upload']}/{STATE_NAME}"))
        except ValueError:   # a damaged upload: its trainer refuses it when the job starts, and says why
            return pointer["step"], None
        return pointer["step"], state.get("data_digest") if isinstance(state, dict) else None
    return saved_data_digest(Path(output_dir) / CHECKPOINT_FOLDER)


def _run_in_process(spec: RunSpec, file: str, quiet: bool, overwrite: bool) -> int:
    """The same run in this process, without Ray (`actors.service.scheduler.local_run`): a debugging aid. Its
    jobs are recorded in the run folder's job table, where `aspen run` keeps its own (so `aspen status`, `aspen
    report` and `aspen run` itself find them), and run again it plans against that table as `aspen run` does
    (`_plan_in_process`); the folder is locked meanwhile, as a service locks it."""
    from actors.engine.warmup import settle_garbage_collector
    from actors.service.scheduler.config import run_local_dir
    from actors.service.scheduler.local_run import held_run_folder, train_locally
    from actors.service.table.recorded_run import CarriedJobs
    from orchestrator.progress import quiet_loading_bars, warn_policy_replaced
    from orchestrator.recent_runs import RecentRuns

    state_dir = run_local_dir(spec) / ".aspen"
    with held_run_folder(state_dir):   # planned and trained under one lock: no run or service writes between
        plan = _plan_in_process(spec, state_dir, overwrite)
        if plan is not None and not (plan.submit or plan.resume or plan.started_over or plan.extend):   # all done
            for line in plan.lines(saved_step=saved_step):
                print(line)
            return _run_summary(spec, spec.output_dir, plan.done)
        # the rows of every job about to train, before anything starts (a bad row fails here, not minutes later)
        check_data_rows(spec, None if plan is None else {s.job.name for s in plan.submit} | {
            r.name for r in (*plan.resume, *plan.started_over, *(r for r, _ in plan.extend))}, file=file)
        for line in [] if plan is None else [*plan.started_over_lines("are"), *plan.lines(saved_step=saved_step)]:
            print(line)   # said once the run goes on: a refusal above deletes nothing
        carry = None if plan is None else CarriedJobs([r.id for r in plan.done], [r.id for r in plan.resume],
                                                      {r.id: submission for r, submission in plan.extend})
        settle_garbage_collector()   # torch's and transformers' objects out of every later full collection
        quiet_loading_bars(quiet)   # transformers' bar as it loads the base
        RecentRuns().remember(file, str(spec.output_dir), state_dir)   # `aspen status` after it ends
        stops = _stop_between_steps()   # Ctrl-C and SIGTERM: the running jobs checkpointed and recorded paused
        try:
            summaries = train_locally(spec, progress=not quiet, record_in=state_dir, stops=stops, carry=carry,
                                      policy_said=warn_policy_replaced)
        except KeyboardInterrupt as interrupt:
            if not stops.began:   # before any step (the base loading): nothing was checkpointed
                raise
            raise RunInterrupted(isinstance(interrupt, Terminated)) from None
    # the same end as `aspen run`'s through a service, and as a run whose jobs were all done already
    return _run_summary(spec, spec.output_dir, [summary.record for summary in summaries])


def _plan_in_process(spec: RunSpec, state_dir: Path, overwrite: bool) -> RunPlan | None:
    """`aspen run`'s plan for the run folder's jobs, with the same lines said and the same refusal of changed jobs
    without --overwrite: done jobs left alone, unfinished ones resumed, new and (--overwrite) changed ones started
    over. None where the folder holds no table yet, or a damaged one (said, with how to restore its backup): every
    job starts over."""
    from actors.service.outputs.earlier_outputs import earlier_outputs
    from actors.service.table.recorded_run import earlier_jobs
    from actors.service.table.table_backup import JobTableDamaged
    from orchestrator.run_plan import plan_run

    try:
        earlier = earlier_jobs(state_dir / "jobs.sqlite")
    except JobTableDamaged:   # the run's first record of its jobs says what is wrong and how to restore the backup
        print(f"aspen: the earlier jobs of {spec.output_dir} cannot be read (its job table is damaged: below); this "
              "run's jobs start over", file=sys.stderr)
        earlier = []
    if not earlier:   # every job is new, and none trains over outputs found in its folder without --overwrite
        refuse_foreign_outputs(spec.output_dir, plan_run(spec.submissions(), [], {}.__getitem__,
                                                         found_outputs=earlier_outputs), [], overwrite)
        return None
    submissions = {record.id: submission for record, submission in earlier}
    plan = plan_run(spec.submissions(), [record for record, _ in earlier], submissions.__getitem__,
                    saved_data=saved_data_digest, saved_step=saved_step, found_outputs=earlier_outputs)
    refuse_restarts(spec.output_dir, plan, overwrite)
    refuse_foreign_outputs(spec.output_dir, plan, [record for record, _ in earlier], overwrite)
    return plan
