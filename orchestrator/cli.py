"""The `aspen` command line: `serve`, `submit`, `status`, `cancel`, `stop` talk to a service on a Ray
cluster; `run` and `demo` start their own service for the run and wait for it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from actors.engine.base_settings import QUANTIZATIONS
from actors.engine.storage import as_location, resolve_location
from orchestrator.jobs_file import SpecError, check_data_rows, load_run_spec
from orchestrator.run_plan import OVERWRITE_HELP

if TYPE_CHECKING:
    from actors.engine.spec import RunSpec
    from actors.service.job_table import JobRecord


def _service_config(args: argparse.Namespace):
    import yaml

    from actors.service.config import ServiceConfig, TrainerConfig

    data: dict = {}
    if args.config:
        data = yaml.safe_load(Path(args.config).read_text()) or {}
    if args.state_dir:
        data["state_dir"] = args.state_dir
    if args.policy:
        data["policy"] = args.policy
    if args.output_root:
        data["output_root"] = args.output_root
    if args.cpu_trainers and args.per_node:
        raise SystemExit("aspen serve: give --cpu-trainers (trainers anywhere on the cluster) or --per-node "
                         "(trainers on every node), not both")
    if args.base_model or args.cpu_trainers or args.per_node:
        trainer = {"base_model": args.base_model or "smollm2-135m", "count": args.cpu_trainers or args.per_node or 1,
                   "nodes": "each" if args.per_node else "any",
                   "quantization": args.quantization, "step_tokens": args.step_tokens}
        data["trainers"] = [TrainerConfig.model_validate(trainer).model_dump()]
    return ServiceConfig.model_validate(data)


def _service(args: argparse.Namespace):
    """The service's client: over the HTTP API with --url (or $ASPEN_URL; no Ray needed), else over Ray."""
    if getattr(args, "url", None):
        from orchestrator.http.api_client import HttpClient

        return HttpClient(args.url)
    from orchestrator.client import Client

    return Client.connect(args.address)


def _cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.client import Client

    client = Client.serve(_service_config(args), address=args.address, insecure=args.insecure)
    info = client.wait_ready()
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return 0
    print(f"aspen service running (state in {info['state_dir']}, policy {info['policy']})")
    if info.get("output_root"):
        print(f"  jobs write under {info['output_root']}")
    if info.get("mqtt_url"):
        print(f"  job events: {info['mqtt_url']} (topics {info.get('mqtt_topics', 'aspen/v1/#')})")
    if info.get("mqtt_credentials"):
        print(f"  job events' read-only account: {info['mqtt_credentials']} (`aspen watch --events` reads it)")
    for trainer in info["trainers"]:
        where = trainer.get("device", "?") + (f" of node {trainer['node_address']}" if trainer.get("node_address")
                                              else "")
        print(f"  {trainer['id']}: {trainer['base_model']} ({trainer['quantization']}) on {where}"
              + (f"  ERROR: {trainer['error']}" if trainer.get("error") else ""))
    for key, value in info.items():   # what the service's listeners report: metrics_url, metrics_error, ...
        if key.endswith(("_url", "_error")):
            print(f"  {key.replace('_', ' ')}: {value}")
    if args.http:
        import ray

        from orchestrator.http.api import serve

        ray.shutdown()   # the service is detached; the API reaches it from a process of its own (http_bridge)
        serve(address=args.address, host=args.http_host, port=args.http_port, state_dir=info["state_dir"])
    return 0


def _cmd_http(args: argparse.Namespace) -> int:
    from orchestrator.http.api import serve

    serve(address=args.address, host=args.host, port=args.port, token_file=args.token_file,
          ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, state_dir=args.state_dir)
    return 0


def _cmd_http_token(args: argparse.Namespace) -> int:
    from actors.service.users import UserBook
    from orchestrator.http.token import ensure_token, token_file

    book = UserBook.in_state_dir(args.state_dir)
    if book.exists():   # the single token opens the API only where an admin holds it
        holder = book.authenticate(ensure_token(args.token_file)) if token_file(args.token_file).is_file() else None
        if holder is None or args.rotate:
            path = token_file(args.token_file)
            whose = "not one of them" if holder is None else (
                f"the admin '{holder.name}''s (`aspen user token {holder.name} --rotate` gives them a new one)")
            print(f"aspen: a users file is in force ({book.path}): the API takes only its users' tokens, and "
                  f"{path} is {whose}. `aspen user add NAME --admin` issues an admin a token; `aspen user token "
                  "NAME --rotate` a user a new one", file=sys.stderr)
            return 1
        print(ensure_token(args.token_file))
        print(f"aspen: this token is the admin '{holder.name}''s (a users file is in force: {book.path})",
              file=sys.stderr)
        return 0
    token = ensure_token(args.token_file, rotate=args.rotate)
    print(token)
    if args.rotate:
        print(f"aspen: a new token is in {token_file(args.token_file)}; restart `aspen http` to use it",
              file=sys.stderr)
    return 0


def _cmd_losses(args: argparse.Namespace) -> int:
    rows = _service(args).losses(args.job)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    fmt = lambda v, spec=".4f": "-" if v is None else format(v, spec)  # noqa: E731 - a formatter local to this table
    print(f"{'step':>6}{'loss':>10}{'eval loss':>11}{'lr':>11}{'grad norm':>11}{'tokens':>9}")
    for row in rows:
        print(f"{row['step']:>6}{fmt(row['loss']):>10}{fmt(row['eval_loss']):>11}{fmt(row['lr'], '.3g'):>11}"
              f"{fmt(row['grad_norm'], '.3g'):>11}{fmt(row['tokens'], 'd'):>9}")
    return 0


def _cmd_submit(args: argparse.Namespace) -> int:
    check_data_rows(load_run_spec(args.file))   # a bad row or template refused here, before anything is submitted
    handles = _service(args).submit_run(args.file)
    if args.json:
        print(json.dumps([{"id": h.id, "name": h.name} for h in handles], indent=1))
        return 0
    for handle in handles:
        print(f"submitted {handle.id} ({handle.name})")
    return 0


def _named_cluster(args: argparse.Namespace) -> bool:
    """Whether the command names a service (--url) or a cluster (--address or $RAY_ADDRESS), rather than
    whatever runs here."""
    address = getattr(args, "address", None) or os.environ.get("RAY_ADDRESS", "auto")
    return bool(getattr(args, "url", None)) or address != "auto"


def _ended_run_or(args: argparse.Namespace, error: Exception):
    """After a run's service ended: its job table (--from, else the newest `aspen run` of this machine), said
    so on stderr; else the error that found no service."""
    from orchestrator.recent_runs import EndedRun, RecentRuns, state_folder

    if args.from_dir:
        folder = state_folder(args.from_dir)
    else:
        run = RecentRuns().latest()
        if run is None:
            raise error
        folder = Path(run.state_dir)
    print("aspen: no aspen service is running; the job table of the run in "
          f"{folder.parent if folder.name == '.aspen' else folder} as it ended (`aspen run` of its jobs file resumes "
          "unfinished jobs)", file=sys.stderr)
    return EndedRun(folder)


def _cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.client import ServiceError
    from orchestrator.progress import print_table, summary_table

    if args.from_dir and args.url:
        raise ValueError("give --from (a run's folder) or --url (a running service), not both")
    try:
        if args.from_dir:
            raise ServiceError("--from given")
        client = _service(args)
    except ServiceError as error:   # no cluster, or no service on it: a run that has ended answers from its table
        if args.url or (not args.from_dir and _named_cluster(args)):   # a cluster named and not there: an error
            raise
        client = _ended_run_or(args, error)
    if args.job:
        record = client.status(args.job)
        if args.json:
            history = [{"time": when, "state": state, "reason": reason}
                       for when, state, reason in client.transitions(record.id)]
            print(json.dumps({**record.as_dict(), "history": history}, indent=1))
            return 0
        for key, value in record.as_dict().items():
            print(f"{key:>16}: {value}")
        print("\n  history:")
        for when, state, reason in client.transitions(record.id):
            print(f"    {when:.3f}  {state:<14} {reason}")
        return 0
    records = client.jobs()
    if args.json:
        print(json.dumps([r.as_dict() for r in records], indent=1))
    else:
        print_table(summary_table(records))
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.client import Client
    from orchestrator.watch import watch

    if args.events:
        from orchestrator.mqtt.settings import reader_settings
        from orchestrator.watch import watch_events

        if args.once:
            raise ValueError("--once shows the job table; --events follows the job events until Ctrl-C (use one)")

        try:
            if args.state_dir:
                settings = reader_settings(args.state_dir)
            else:
                settings = Client.connect(args.address).event_settings()
            print(f"job events from {settings.url} (as {settings.username}, settings in {settings.source}); "
                  "Ctrl-C to leave", file=sys.stderr, flush=True)
            watch_events(settings, progress=args.progress, as_json=args.json)
        except OSError as error:   # no or unreadable credentials, a refused or lost connection
            print(f"aspen: {error}", file=sys.stderr)
            return 2
        return 0
    if args.state_dir or args.progress:
        raise ValueError("--state-dir and --progress go with --events")
    if args.json and not args.once:
        raise ValueError("--json goes with --once (the job table once, as JSON) or --events (one JSON object per "
                         "event); the live table has no JSON form")
    client = Client.connect(args.address)
    if args.json:
        print(json.dumps([r.as_dict() for r in client.jobs()], indent=1))
        return 0
    console = Console(width=max(Console().width, 140)) if args.once and not sys.stdout.isatty() else Console()
    watch(client.jobs, once=args.once, interval=args.interval, console=console)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from orchestrator.report import collect, report_data, write_report

    if args.run_dir is None:
        from orchestrator.recent_runs import RecentRuns

        run = RecentRuns().latest()
        if run is None:
            raise ValueError("give a run's output folder (aspen report DIR): no `aspen run` on this machine is known")
        args.run_dir = run.output_dir
        print(f"aspen: the run in {run.output_dir} (the newest `aspen run` on this machine)", file=sys.stderr)
    if args.json:
        print(json.dumps(report_data(collect(as_location(args.run_dir))), indent=1))
        return 0
    write_report(as_location(args.run_dir), console=Console(width=max(Console().width, 120)))
    return 0


def _job_command(verb: str, running_note: str):
    """`aspen cancel|pause|resume JOB`: the client's `verb` on one job, and the job's record after it."""

    def command(args: argparse.Namespace) -> int:
        record = getattr(_service(args), verb)(args.job)
        if args.json:
            print(json.dumps(record.as_dict(), indent=1))
        elif record.state == "running" and running_note:
            print(f"{record.id}: {record.state} ({running_note})")
        else:
            print(f"{record.id}: {record.state} ({record.reason})")
        return 0

    return command


_cmd_cancel = _job_command("cancel", "cancelling at its next step")
_cmd_pause = _job_command("pause", "pausing at its next step")
_cmd_resume = _job_command("resume", "")


def _cmd_stop(args: argparse.Namespace) -> int:
    from orchestrator.client import Client

    Client.connect(args.address).shutdown()
    print("aspen service stopped (unfinished jobs resume from their checkpoints when it starts again)")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """Train a jobs file through a service of its own. Run again on the same output folder, it resumes the
    unfinished jobs from their checkpoints and leaves finished ones alone (`orchestrator.run_plan`)."""
    spec = load_run_spec(args.file)
    if args.output_dir:
        spec = spec.model_copy(update={"output_dir": resolve_location(args.output_dir)})
    if args.in_process:
        check_data_rows(spec)
        return _run_in_process(spec, args.quiet)
    from actors.service.config import run_local_dir, run_service_config
    from actors.service.job_files import clear_job_folder
    from actors.service.job_table import read_jobs
    from orchestrator.run_plan import changed_message, plan_run

    output_dir = resolve_location(spec.output_dir)
    spec = spec.model_copy(update={"output_dir": output_dir})
    # The plan needs only the job table. Read without a service first: a run whose jobs are all done, or whose
    # spec or data changed, answers at once, with no Ray started; else the service's own table is asked (it
    # may have been changed since, by a run that was still ending), and the trainers (a model load each) are
    # waited for only where there is something to train.
    earlier = read_jobs(run_local_dir(spec) / ".aspen" / "jobs.sqlite")
    data_checked: set[str] = set()   # folders of jobs whose data matched their checkpoint in the first plan
    if earlier is not None:
        submissions = {record.id: submission for record, submission in earlier}
        plan = plan_run(spec.submissions(), [record for record, _ in earlier], submissions.__getitem__,
                        saved_data=_saved_data_digest, saved_step=_saved_step)
        if plan.changed and not args.overwrite:
            raise RunSpecChanged(changed_message(output_dir, plan.changed))
        if not (plan.submit or plan.resume or plan.changed):
            for line in plan.lines(saved_step=_saved_step):
                print(line)
            return _run_summary(spec, output_dir, plan.done)
        data_checked = {record.output_dir for record in (*plan.resume, *plan.done)}
    # the rows of every job about to train, before anything starts (a bad row fails here, not minutes later)
    check_data_rows(spec, None if earlier is None else {s.job.name for s in plan.submit} | {
        r.name for r in (*plan.resume, *plan.changed_records)})
    from orchestrator.client import Client
    from orchestrator.progress import follow_jobs, wait_for_trainers

    # jobs left unfinished by an earlier run are held (paused) until this run's plan says what to do
    config = run_service_config(spec, resume_on_start=False)
    client = Client.local(config, address=os.environ.get("RAY_ADDRESS"), wait_ready=False)
    _terminate_as_interrupt()
    from orchestrator.recent_runs import RecentRuns

    RecentRuns().remember(args.file, str(output_dir), config.state_dir)   # `aspen status` after it ends
    try:
        # each job's data is read for its digest once per run: not again for the jobs the first plan checked
        plan = plan_run(spec.submissions(), client.jobs(), lambda job: client.submission(job),
                        saved_data=lambda folder: None if folder in data_checked else _saved_data_digest(folder),
                        saved_step=_saved_step)
        if plan.changed and not args.overwrite:
            raise RunSpecChanged(changed_message(output_dir, plan.changed))
        # only the jobs whose spec or data changed start over: unchanged ones resume or stay as they are
        restarted = [*plan.changed_records, *(record for record, _ in plan.retry)]
        for record in restarted:
            client.delete(record.id)
            clear_job_folder(as_location(record.output_dir))
        for record in plan.changed_records:
            print(f"{record.name}: started over (--overwrite: its spec or data changed); its earlier results were "
                  "deleted")
        if restarted:
            plan = plan_run(spec.submissions(), client.jobs(), lambda job: client.submission(job),
                            saved_step=_saved_step)
        for line in plan.lines(saved_step=_saved_step):
            print(line)
        if plan.resume or plan.submit:
            wait_for_trainers(client, quiet=args.quiet)
        for record in plan.resume:
            client.resume(record.id, "resumed by aspen run")
        ids = {r.id for r in (*plan.resume, *plan.done)}
        ids |= {h.id for h in client.submit_many(plan.submit)} if plan.submit else set()
        try:
            records = follow_jobs(lambda: [r for r in client.jobs() if r.id in ids], quiet=args.quiet)
        except KeyboardInterrupt as interrupt:
            what = "stopped (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"
            print(f"aspen: {what}; checkpointing the running jobs ...", file=sys.stderr, flush=True)
            raise RunInterrupted(terminated=isinstance(interrupt, Terminated)) from None
    finally:
        client.shutdown()
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


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during `aspen run`: the running jobs were checkpointed."""

    def __init__(self, terminated: bool = False):
        super().__init__()
        self.terminated = terminated


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a job system's stop) while a command that started a service of its own runs."""


def _terminate_as_interrupt() -> None:
    """Make SIGTERM stop this command as Ctrl-C does (the running jobs checkpointed, the service shut down, one
    line said), in place of Ray's handler, which the service's start installed and which prints a C++ stack
    and leaves the jobs to their last checkpoint. Called after `ray.init`, in the main thread."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, stop)


def _saved_step(output_dir: str) -> int | None:
    """The step of the job's checkpoint: the one uploaded to a storage URI (its pointer), or on disk."""
    from actors.engine.checkpoint import saved_step
    from actors.engine.storage import StorageLocation, is_uri, read_pointer
    from actors.service.job_files import CHECKPOINT_FOLDER

    if is_uri(output_dir):
        pointer = read_pointer(StorageLocation(output_dir))
        return None if pointer is None else pointer["step"]
    return saved_step(Path(output_dir) / CHECKPOINT_FOLDER)


def _saved_data_digest(output_dir: str) -> tuple[int, str | None] | None:
    """The step and data digest of the job's checkpoint (the one uploaded to a storage URI, or on disk)."""
    from actors.engine.checkpoint import STATE_NAME, saved_data_digest
    from actors.engine.storage import StorageLocation, is_uri, read_pointer
    from actors.service.job_files import CHECKPOINT_FOLDER

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


def _run_in_process(spec, quiet: bool) -> int:
    """The same run in this process, without Ray (`actors.service.local_run`): a debugging aid."""
    from actors.service.local_run import train_locally

    summaries = train_locally(spec, progress=not quiet)
    print(f"\n{'job':<24}{'state':>14}{'steps':>7}{'tokens':>10}{'first loss':>12}{'final loss':>12}{'eval loss':>11}")
    for s in summaries:
        fmt = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731 - a formatter local to this table
        print(f"{s.name:<24}{s.state:>14}{s.steps:>7}{s.tokens:>10}{fmt(s.first_loss):>12}{fmt(s.final_loss):>12}"
              f"{fmt(s.eval_loss):>11}")
    print(f"\nadapters and metrics in {spec.output_dir}")
    failed = [s for s in summaries if s.state not in ("completed", "stopped_early")]
    for summary in failed:
        print(f"aspen: job {summary.name} {summary.state}: {summary.reason}", file=sys.stderr)
    return 1 if failed else 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    """`aspen sweep FILE`: the sweep run by a service of its own (or the running one at --address / --url),
    followed to its end; run again, it carries on. `aspen sweep status NAME|FOLDER`: its leaderboard."""
    from orchestrator.sweep import follow_sweep, leaderboard_table, load_sweep_spec, service_run_spec

    if args.target[0] == "status" and len(args.target) == 2:
        return _sweep_status(args, args.target[1])
    if len(args.target) != 1:
        raise SpecError("give a sweep file (aspen sweep FILE) or aspen sweep status NAME")
    spec = load_sweep_spec(args.target[0])
    from actors.service.config import run_service_config
    from orchestrator.recent_runs import RecentRuns

    config = run_service_config(service_run_spec(spec))
    # `aspen sweep status NAME` once its service has ended: the sweep's folder (its leaderboard) is remembered
    RecentRuns().remember(args.target[0], str(spec.output_dir), config.state_dir, sweep=spec.name)
    if args.address or args.url:
        service = _service(argparse.Namespace(url=args.url, address=args.address or "auto"))
        status = follow_sweep(service, service.sweep(spec)["name"], poll_s=args.poll)
    else:
        from orchestrator.client import Client
        from orchestrator.progress import wait_for_trainers

        client = Client.local(config, address=os.environ.get("RAY_ADDRESS"), wait_ready=False)
        _terminate_as_interrupt()
        try:
            wait_for_trainers(client)
            status = follow_sweep(client, client.sweep(spec)["name"], poll_s=args.poll)
        finally:
            client.shutdown()
    board = {"trials": status["trials"], "best": status["best"]}
    print(json.dumps(board, indent=1) if args.json else leaderboard_table(board))
    if status["state"] == "failed":
        print(f"aspen: sweep {spec.name} failed: {status['error']}", file=sys.stderr)
        return 1
    return 0 if board["best"] is not None else 1


def _sweep_status(args: argparse.Namespace, name: str) -> int:
    """A sweep's leaderboard: from its folder (an ended sweep, no service needed), else from the service."""
    from orchestrator.sweep import leaderboard_table, read_results

    if Path(name).is_dir():
        status = {"name": Path(name).name, "state": "ended", **read_results(Path(name))}
    else:
        from orchestrator.client import ServiceError
        from orchestrator.recent_runs import RecentRuns

        try:
            service = _service(argparse.Namespace(url=args.url, address=args.address or os.environ.get(
                "RAY_ADDRESS", "auto")))
        except ServiceError:   # its service ended: the sweep's own folder has its leaderboard
            run = None if _named_cluster(args) else RecentRuns().find_sweep(name)
            if run is None:
                raise
            print(f"aspen: no aspen service is running; sweep {name}'s leaderboard "
                  f"in {run.output_dir} as it ended", file=sys.stderr)
            status = {"name": name, "state": "ended", **read_results(Path(run.output_dir))}
        else:
            status = service.sweep_status(name)
    if args.json:
        print(json.dumps(status, indent=1))
    else:
        print(f"sweep {status['name']}: {status['state']}" + (f" ({status['error']})" if status.get("error") else ""))
        print(leaderboard_table(status))
    return 0


def _export_over_http(args: argparse.Namespace) -> Path:
    """`aspen export JOB --url`: the adapter fetched through the HTTP API; with --merge merged here."""
    import tempfile

    from actors.engine.adapter_export import export_merged
    from orchestrator.http.api_client import HttpClient

    with HttpClient(args.url) as client:
        if not args.merge:
            return client.export(args.job, args.out, checkpoint=args.checkpoint, force=args.force)
        record = client.status(args.job)
        out = Path(args.out) if args.out else Path.cwd() / f"{record.name}-merged"
        with tempfile.TemporaryDirectory(prefix="aspen-export-") as scratch:
            adapter = client.export(record.id, Path(scratch) / "adapter", checkpoint=args.checkpoint)
            return export_merged(adapter, out, base=args.base, dtype=args.dtype, force=args.force)


def _cmd_export(args: argparse.Namespace) -> int:
    """`aspen export JOB`: a PEFT folder for vLLM's --lora-modules, or with --merge a merged transformers folder."""
    from orchestrator.export import export_job

    def service(job: str):
        from orchestrator.client import Client, ServiceError

        try:
            return Client.connect(args.address).status(job)
        except ServiceError as error:
            from orchestrator.recent_runs import EndedRun, RecentRuns

            run = RecentRuns().find(job)   # a run that has ended: its own job table knows where the job is
            if run is not None:
                print(f"aspen: no aspen service is running; '{job}' is a job of the run in {run.output_dir}",
                      file=sys.stderr)
                return EndedRun(run.state_dir).status(job)
            raise ServiceError(f"'{job}' is not a job folder, and asking the service for it failed: {error}; give "
                               "the job's folder, or --from with the run's output folder") from None

    if not sys.stderr.isatty():   # transformers' loading and writing bars, redrawn as text: not for a log
        from transformers.utils import logging as transformers_logging
        transformers_logging.disable_progress_bar()
    if args.url and args.from_dir is None:   # over the HTTP API: the service sends it (its owner's or an admin's)
        out = _export_over_http(args)
    else:
        out = export_job(args.job, args.out, merge=args.merge, force=args.force, checkpoint=args.checkpoint,
                         run_dir=args.from_dir, base=args.base, dtype=args.dtype, service=service)
    if args.json:
        print(json.dumps({"job": args.job, "folder": str(out), "merged": args.merge}, indent=1))
    elif args.merge:
        print(f"merged model (transformers, safetensors) in {out}; serve it with:\n  vllm serve {out.resolve()}\n"
              f"or load it with transformers: AutoModelForCausalLM.from_pretrained({str(out.resolve())!r})")
    else:
        print(f"PEFT adapter in {out}")
        print(_serving_text(out))
    return 0


def _serving_text(adapter: Path) -> str:
    """How to serve and load an exported adapter, as lines that run on this machine (actors/engine/serving_lines)."""
    from actors.engine.serving_lines import adapter_serving_lines

    try:
        lines = adapter_serving_lines(adapter)
    except (OSError, ValueError, KeyError) as error:   # the base is not on this machine (an export over HTTP)
        return (f"its base is not on this machine ({error}); load it with PEFT onto the base its "
                f"adapter_config.json names (base_model_name_or_path)")
    parts = []
    if lines.vllm:
        parts.append(f"Serve it on this machine:\n  {lines.vllm}")
    parts.append("Load it with PEFT:\n" + "\n".join(f"  {line}" if line else "" for line in lines.peft.splitlines()))
    parts.append(lines.elsewhere)
    return "\n".join(parts)


def _cmd_demo(args: argparse.Namespace) -> int:
    from orchestrator.demo import run_demo

    return run_demo(output_dir=args.output_dir, steps=args.steps, quiet=args.quiet)

def _step_tokens(value: str) -> int | str:
    """--step-tokens: a number of tokens, or auto."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is neither a number of tokens nor auto") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aspen", description="Fine-tune many LoRA adapters at once on one "
                                     "shared, frozen base model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true", help="on an error, also print its traceback")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_json(command: argparse.ArgumentParser, what: str) -> argparse.ArgumentParser:
        command.add_argument("--json", action="store_true", help=f"print {what} as JSON")
        return command

    def with_address(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                             help="Ray cluster (default: $RAY_ADDRESS or the cluster on this machine)")
        return command

    def with_url(command: argparse.ArgumentParser) -> argparse.ArgumentParser:
        command.add_argument("--url", default=os.environ.get("ASPEN_URL"),
                             help="talk to the service through its HTTP API at this URL (`aspen http`), without Ray "
                                  "(default: $ASPEN_URL; the token from $ASPEN_TOKEN or ~/.aspen/http-token)")
        return command

    serve = with_address(commands.add_parser("serve", help="start the service on the Ray cluster and return"))
    serve.add_argument("--config", help="service YAML (state_dir, trainers, policy)")
    serve.add_argument("--state-dir", help="where the job table and outputs live (default ~/.aspen)")
    serve.add_argument("--base-model", help="one kind of trainer with this base model (default smollm2-135m)")
    serve.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    serve.add_argument("--cpu-trainers", type=int, help="how many trainers of that kind (spread over the cluster)")
    serve.add_argument("--per-node", type=int, help="trainers of that kind on every node of the cluster, following "
                                                     "nodes as they join and leave")
    serve.add_argument("--step-tokens", type=_step_tokens, default="auto",
                       help="token budget of one fused step, or auto (default: 1024 on CPU, up to 8192 on a GPU by "
                            "the memory model)")
    serve.add_argument("--policy", help="scheduling policy: adaptive (default), fifo, sjf, priority, module:Class "
                                        "or an installed entry point (group aspen.policies)")
    serve.add_argument("--output-root", help="submitted jobs write only under this folder or storage URI, e.g. "
                       "s3://bucket/aspen (default: <state dir>/outputs)")
    serve.add_argument("--insecure", action="store_true", help="start the service even on a Ray cluster without "
                       "token authentication (by default refused: anyone who reaches such a cluster runs code on it)")
    serve.add_argument("--http", action="store_true", help="then serve the HTTP API in this process (as `aspen "
                       "http`) until Ctrl-C; the service keeps running after")
    serve.add_argument("--http-host", default="127.0.0.1", help="with --http: the address to bind (default loopback)")
    serve.add_argument("--http-port", type=int, default=8765, help="with --http: the port (default 8765)")
    with_json(serve, "the running service's description (trainers, URLs, state dir)")
    serve.set_defaults(handler=_cmd_serve)

    http = with_address(commands.add_parser("http", help="serve the HTTP API of the running service (submit, list, "
                                                       "status, cancel, losses, events; token auth) until Ctrl-C"))
    http.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                      "another one is warned about)")
    http.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    http.add_argument("--token-file", help="the bearer token's file (default ~/.aspen/http-token, generated with mode "
                      "0600 where missing)")
    http.add_argument("--state-dir", default=None,
                      help="the folder of the users file (`aspen user add`) and the audit log (default: the service's "
                           "own state folder, which it is asked for)")
    http.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM)")
    http.add_argument("--ssl-keyfile", help="and this private key (PEM)")
    http.set_defaults(handler=_cmd_http)

    http_token = commands.add_parser("http-token", help="print the HTTP API's bearer token (generated where missing)")
    http_token.add_argument("--token-file", help="default ~/.aspen/http-token")
    http_token.add_argument("--state-dir", default="~/.aspen",
                            help="the service's state folder: where a users file is in force, the token is printed "
                                 "only while an admin holds it (default ~/.aspen)")
    http_token.add_argument("--rotate", action="store_true", help="replace it with a new token (restart `aspen http`)")
    http_token.set_defaults(handler=_cmd_http_token)

    from orchestrator import users_cli

    users_cli.add_parser(commands)

    losses = with_url(with_address(commands.add_parser("losses", help="a job's loss history: one row per optimizer "
                                                                    "step (loss, eval loss, lr, grad norm, tokens)")))
    losses.add_argument("job", help="job id (or a unique job name)")
    with_json(losses, "the rows")
    losses.set_defaults(handler=_cmd_losses)

    submit = with_url(with_address(commands.add_parser("submit", help="submit the jobs of a jobs YAML file")))
    submit.add_argument("file")
    with_json(submit, "the submitted jobs' ids and names")
    submit.set_defaults(handler=_cmd_submit)

    status = with_url(with_address(commands.add_parser("status", help="all jobs, or one job in detail")))
    status.add_argument("--from", dest="from_dir", help="a run's output folder: its job table as the run left it "
                        "(default where no service runs: the newest `aspen run` on this machine)")
    status.add_argument("job", nargs="?", help="job id (or a unique job name)")
    with_json(status, "the jobs (one job: with its state history)")
    status.set_defaults(handler=_cmd_status)

    watch = with_address(commands.add_parser("watch", help="a live table of the jobs: state, step, loss, tokens/s, "
                                                         "ETA (Ctrl-C to leave)"))
    watch.add_argument("--once", action="store_true", help="print the table once and exit")
    watch.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    watch.add_argument("--events", action="store_true", help="instead of the table: one line per job state change "
                       "and job event as the service publishes them over MQTT (its embedded broker's read-only "
                       "account, from the service's state dir; Ctrl-C to leave)")
    watch.add_argument("--state-dir", help="with --events: the service's state dir to read the MQTT reader account "
                       "from (default: ask the service for it)")
    watch.add_argument("--progress", action="store_true", help="with --events: also a line per optimizer step")
    with_json(watch, "with --once: the jobs; with --events: one JSON object per event (topic, retained, payload)")
    watch.set_defaults(handler=_cmd_watch)

    report = commands.add_parser("report", help="loss curves (report.png) and a summary table (report.md) of "
                                                "a run's jobs")
    report.add_argument("run_dir", nargs="?", help="a run's output folder (one folder per job) or a service's state "
                                                   "folder (default: the newest `aspen run` on this machine)")
    with_json(report, "each job's numbers and loss curve (no files written)")
    report.set_defaults(handler=_cmd_report)

    cancel = with_url(with_address(commands.add_parser("cancel", help="cancel a job (it is checkpointed first)")))
    cancel.add_argument("job")
    with_json(cancel, "the job's record")
    cancel.set_defaults(handler=_cmd_cancel)

    pause = with_url(with_address(commands.add_parser("pause", help="pause a job (it is checkpointed; `aspen "
                                                                  "resume` continues it)")))
    pause.add_argument("job")
    with_json(pause, "the job's record")
    pause.set_defaults(handler=_cmd_pause)

    resume = with_url(with_address(commands.add_parser("resume", help="queue a paused, failed or cancelled job "
                                                                    "again; it continues from its last checkpoint")))
    resume.add_argument("job")
    with_json(resume, "the job's record")
    resume.set_defaults(handler=_cmd_resume)

    stop = with_address(commands.add_parser("stop", help="stop the service (jobs are checkpointed)"))
    stop.set_defaults(handler=_cmd_stop)

    run = commands.add_parser("run", help="train every job of a jobs YAML file through a service of its own, "
                                          "with a progress bar per job")
    run.add_argument("file", help="jobs YAML file")
    run.add_argument("--output-dir", help="override output_dir of the file (a folder or a storage URI, "
                     "e.g. s3://bucket/runs/x)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress display")
    run.add_argument("--in-process", action="store_true", help="train in this process, without Ray")
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    run.set_defaults(handler=_cmd_run)

    sweep = commands.add_parser("sweep", help="a sweep file's trials trained as jobs of a service of its own (or "
                                              "the running one: --address, --url), the weak ones stopped early; "
                                              "ends with the leaderboard. `aspen sweep status NAME|FOLDER`: a sweep's "
                                              "leaderboard")
    sweep.add_argument("target", nargs="+", metavar="FILE | status NAME",
                       help="sweep YAML file (docs/sweeps.md), or `status` and a sweep's name (or its folder)")
    sweep.add_argument("--address", help="a running service's Ray cluster (default: a service of the sweep's own)")
    sweep.add_argument("--url", help="a running service's HTTP API (`aspen http`)")
    sweep.add_argument("--json", action="store_true", help="print the leaderboard as JSON")
    sweep.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the trials (default 1)")
    sweep.set_defaults(handler=_cmd_sweep)

    export = with_address(commands.add_parser("export", help="write a job's adapter as a PEFT folder (vLLM "
                                                             "--lora-modules), or merged into its base (--merge)"))
    export.add_argument("job", help="the job's folder, or its id or name (in --from DIR, else in the service)")
    export.add_argument("--out", help="the folder to write (default ./<job>-lora, with --merge ./<job>-merged)")
    export.add_argument("--merge", action="store_true", help="the base with the adapter merged, as a transformers "
                        "folder (config.json, model.safetensors, tokenizer)")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    export.add_argument("--from", dest="from_dir", help="a run's output folder or a service's state folder to find "
                        "JOB in (without it, a JOB that is not a folder is looked up in the running service)")
    export.add_argument("--checkpoint", action="store_true", help="export the job's last checkpoint instead of its "
                        "final adapter (e.g. of a job still running)")
    export.add_argument("--base", help="with --merge: load the base from here (a folder, a .gguf file, a cached hub "
                        "id) instead of where the job trained on it")
    export.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="with --merge: the merged weights' dtype (auto: the base's)")
    with_url(export)
    with_json(export, "the folder written")
    export.set_defaults(handler=_cmd_export)

    demo = commands.add_parser("demo", help="train 4 small generated tasks on smollm2-135m and show accuracy")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per job")
    demo.add_argument("-q", "--quiet", action="store_true")
    demo.set_defaults(handler=_cmd_demo)
    return parser


EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 130, 143


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for bad usage or a bad jobs file or request, 1 for a runtime failure (a job
    failed, the cluster or service cannot be reached), 130 for Ctrl-C, 143 for SIGTERM. Errors are one line;
    --debug adds the traceback."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except KeyboardInterrupt as interrupt:
        _debug(args)
        terminated = isinstance(interrupt, Terminated) or getattr(interrupt, "terminated", False)
        what = "stopped (SIGTERM)" if terminated else "interrupted"
        if isinstance(interrupt, RunInterrupted):
            print(f"aspen: {what}; the running jobs were checkpointed, and the same command continues where "
                  "they stopped", file=sys.stderr)
        else:
            print(f"aspen: {what}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except SpecError as error:
        _debug(args)
        kind = "sweep file" if getattr(args, "handler", None) is _cmd_sweep else "jobs file"
        print(f"aspen: invalid {kind}:\n{error}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:  # noqa: BLE001 - every error ends as one line (the traceback with --debug)
        _debug(args)
        code, message = _describe(error)
        print(f"aspen: {message}", file=sys.stderr)
        return code


def _describe(error: Exception) -> tuple[int, str]:
    """The exit code and the one line for an error that ended a command."""
    from orchestrator.http.api_client import HttpApiError

    if isinstance(error, HttpApiError):   # 401/403: the token (exit 3); other 4xx: the request (exit 2); 5xx or
        if error.status in (401, 403):    # no connection: the service (exit 1)
            return EXIT_REFUSED, str(error)
        return (EXIT_USAGE if 400 <= error.status < 500 else EXIT_FAILED), str(error)
    from actors.service.table_backup import JobTableDamaged
    from orchestrator.client import ServiceError

    if isinstance(error, (ServiceError, JobTableDamaged)):   # their message is the one line, with the fix
        return EXIT_FAILED, str(error)
    if isinstance(error, KeyError):     # an unknown job: the service's message is its first argument
        return EXIT_USAGE, str(error.args[0] if error.args else error)
    if isinstance(error, (ValueError, FileNotFoundError, IsADirectoryError)):
        return EXIT_USAGE, str(error)
    if isinstance(error, OSError):
        return EXIT_FAILED, str(error)
    text = str(error).strip().splitlines()
    return EXIT_FAILED, (f"{type(error).__name__}: {text[-1] if text else ''} (run again with --debug for the "
                         "traceback)")


def _debug(args: argparse.Namespace) -> None:
    if getattr(args, "debug", False):
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())

