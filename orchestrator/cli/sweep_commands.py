"""`aspen sweep FILE` (a sweep run by a service of its own, or the running one, followed to its end), `aspen sweep
status NAME|FOLDER` (its leaderboard) and `aspen sweep cancel NAME`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import strict_json
from orchestrator.cli.run_commands import _terminate_as_interrupt, checkpointing_on_interrupt
from orchestrator.cli.service_commands import connect_service, named_cluster
from orchestrator.jobs_file import SpecError

if TYPE_CHECKING:
    from actors.spec.run_spec import RunSpec
    from actors.spec.sweep_spec import SweepSpec
    from orchestrator.client import Client


def cmd_sweep(args: argparse.Namespace) -> int:
    """`aspen sweep FILE`: the sweep run by a service of its own (or the running one at --address / --url),
    followed to its end; run again, it carries on. `aspen sweep status NAME|FOLDER`: its leaderboard."""
    from orchestrator.sweep import follow_sweep, leaderboard_table, load_sweep_spec

    if args.target[0] == "status" and len(args.target) == 2:
        return _sweep_status(args, args.target[1])
    if args.target[0] == "cancel" and len(args.target) == 2:
        return _sweep_cancel(args, args.target[1])
    if len(args.target) != 1:
        raise SpecError("give a sweep file (aspen sweep FILE), or aspen sweep status NAME, or aspen sweep cancel "
                        f"NAME (not {' '.join(args.target)})")
    spec = load_sweep_spec(args.target[0])
    from actors.service.scheduler.config import run_local_dir, run_service_config
    from orchestrator.base_check import check_sweep_target_modules

    check_sweep_target_modules(spec, args.target[0])   # before a service starts (or is asked), a trial entered
    from orchestrator.recent_runs import RecentRuns

    run = _sweep_run(spec, args.target[0])
    if not args.url:   # its rows under each setting that changes them (over --url the HTTP API checks them)
        from orchestrator.row_checks import check_sweep_data_rows

        check_sweep_data_rows(spec, source=args.target[0])
    config = run_service_config(run)
    # `aspen sweep status NAME` once its service has ended: the sweep's folder (its leaderboard) is remembered
    RecentRuns().remember(args.target[0], str(spec.output_dir), config.state_dir, sweep=spec.name)
    if args.address or args.url:
        service = connect_service(argparse.Namespace(url=args.url, address=args.address or "auto"))
        started = service.sweep(spec) if args.url else service.sweep(spec, check_rows=False)   # rows read above
        say_replaced(started)
        status = follow_sweep(service, started["name"], poll_s=args.poll)
    else:
        from orchestrator.client import Client
        from orchestrator.progress import wait_for_trainers

        client = Client.local(config, address=os.environ.get("RAY_ADDRESS"), wait_ready=False)
        _terminate_as_interrupt()
        command = f"`aspen sweep {args.target[0]}`"
        then = (f"{command} carries the sweep on from them (its unfinished trials are held paused until then: "
                f"aspen status --from {run_local_dir(run)})")
        try:
            with checkpointing_on_interrupt("trials", then):
                wait_for_trainers(client)
                started = client.sweep(spec, check_rows=False)   # first: a sweep it replaces cancels its held trials
                say_replaced(started)
                resume_held_trials(client)
                status = follow_sweep(client, started["name"], poll_s=args.poll)
        finally:   # unfinished trials held paused (not queued for a service that is gone), saying what continues them
            client.shutdown(hold=command.replace("{", "{{").replace("}", "}}") + " continues it from {step}")
    board = {"trials": status["trials"], "best": status["best"]}
    print(strict_json.dumps(board, indent=1) if args.json else leaderboard_table(board))
    if status["state"] == "failed":
        print(f"aspen: sweep {spec.name} failed: {status['error']}", file=sys.stderr)
        if status["trials"]:   # its state is kept (a damaged state file's error says what to do instead)
            print(f"aspen: once that is fixed, `aspen sweep {args.target[0]}` again carries the sweep on from where "
                  f"it was, its trials too (`aspen sweep cancel {spec.name}` on a running service ends them)",
                  file=sys.stderr)
        return 1
    return 0 if board["best"] is not None else 1


def say_replaced(started: dict) -> None:
    """Where a failed or cancelled sweep of that name, which this one replaces, left its results (docs/sweeps.md)."""
    replaced = started.get("replaced")
    if replaced:
        print(f"aspen: sweep {replaced['name']} ({replaced['state']}) had other settings and is replaced: its "
              f"leaderboard, report and trial folders were moved to {replaced['folder']} (its trials' jobs "
              f"{', '.join(replaced['jobs'].values()) or 'none'} with them: aspen status, aspen export find them "
              "there)",
              file=sys.stderr)


def resume_held_trials(client: Client) -> None:
    """The trials an interrupted `aspen sweep` of this folder held paused as its service stopped, resumed (from their
    checkpoints): its driver, carried on, follows their jobs again. A job its user paused stays paused."""
    from actors.service.table.recorded_run import HELD_REASON

    for record in client.jobs():
        if record.state == "paused" and record.reason.startswith(HELD_REASON):
            client.resume(record.id, "resumed by aspen sweep")


def _sweep_run(spec: SweepSpec, source: str) -> RunSpec:
    """The run a sweep's own service is configured from; a job no step of the sweep's step_tokens holds is refused
    naming the sweep file and the field (as a jobs file's is), not as a bare validation error of a RunSpec."""
    from pydantic import ValidationError

    from orchestrator.sweep import service_run_spec

    try:
        return service_run_spec(spec)
    except ValidationError as error:
        lines = [f"{source}: job.{'.'.join(str(part) for part in problem['loc'][2:])}: "
                 f"{problem['msg'].removeprefix('Value error, ')}" for problem in error.errors()]
        raise SpecError("\n".join(lines)) from None


def _sweep_cancel(args: argparse.Namespace, name: str) -> int:
    """Cancel a running service's sweep: its running trials are cancelled (checkpointed), none more start. With
    --from OUTPUT_DIR: a sweep whose service is not running (`aspen sweep FILE` interrupted), in its folder's state
    (orchestrator/ended_sweep.py)."""
    if args.from_dir:
        from orchestrator.ended_sweep import cancel_in_folder
        from orchestrator.recent_runs import state_folder

        if args.url or args.address:
            raise ValueError("give --from (an ended sweep's output_dir) or --url/--address (a running service), "
                             "not both")
        status = cancel_in_folder(state_folder(args.from_dir), name)
    else:
        service = connect_service(argparse.Namespace(url=args.url, address=args.address or os.environ.get(
            "RAY_ADDRESS", "auto")))
        status = service.cancel_sweep(name)
    print(strict_json.dumps(status, indent=1) if args.json else f"sweep {status['name']}: {status['state']} "
          "(cancelling: its running trials are cancelled, none more start; `aspen sweep status NAME` follows it)")
    if status.get("failed_before"):
        print(f"aspen: sweep {name} had failed ({status['failed_before']}); it is cancelled now", file=sys.stderr)
    for problem in status.get("problems") or []:   # logged by the service too; the cancel went on
        print(f"aspen: sweep {name} cancelled, though: {problem}", file=sys.stderr)
    return 0


def _sweep_status(args: argparse.Namespace, name: str) -> int:
    """A sweep's leaderboard: from its folder (an ended sweep, no service needed), else from the service."""
    from orchestrator.sweep import leaderboard_table, read_results

    if Path(name).is_dir():
        status = {"name": Path(name).name, "state": "ended", **read_results(Path(name))}
    else:
        from orchestrator.errors import ServiceError
        from orchestrator.recent_runs import RecentRuns

        try:
            service = connect_service(argparse.Namespace(url=args.url, address=args.address or os.environ.get(
                "RAY_ADDRESS", "auto")))
        except ServiceError as error:   # its service ended: the sweep's own folder has its leaderboard
            run = None if named_cluster(args) else RecentRuns().find_sweep(name)
            if run is None:
                raise
            print(f"aspen: no aspen service is running ({str(error).split(';')[0]}); sweep {name}'s "
                  f"leaderboard in {run.output_dir} as it ended", file=sys.stderr)
            status = {"name": name, "state": "ended", **read_results(Path(run.output_dir))}
        else:
            status = service.sweep_status(name)
    if args.json:
        print(strict_json.dumps(status, indent=1))
    else:
        print(f"sweep {status['name']}: {status['state']}" + (f" ({status['error']})" if status.get("error") else ""))
        raised = status.get("searcher_errors")
        if raised:   # a cancelled sweep's searcher, told how its trials ended: logged by the service, ignored
            print(f"its searcher raised {raised['count']} time(s) since it was cancelled (ignored); the last: "
                  + "; ".join(raised["last"]))
        replaced = status.get("replaced")
        if replaced and "folder" in replaced:   # a service's sweep: the one of that name it replaced, its results
            print(f"it replaced sweep {replaced['name']} ({replaced['state']}), whose results are in "
                  f"{replaced['folder']}")
        elif replaced:   # a replaced-<k> folder's leaderboard: this sweep was replaced, its results moved here
            print(f"it was replaced ({replaced.get('state')}) by a sweep of other settings; its results moved here "
                  f"from {replaced.get('output_dir')}")
        print(leaderboard_table(status))
    return 0
