"""`aspen`'s entry point: the parsed command run, every error ended as one line and an exit code."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import TYPE_CHECKING

from orchestrator.jobs_file import SpecError

if TYPE_CHECKING:
    pass
from orchestrator.cli.parser import build_parser
from orchestrator.cli.run_commands import RunInterrupted, Terminated

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_QUOTA, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 3, 4, 130, 143
TRAINING_COMMANDS = ("run", "sweep")   # the commands that stop a service of their own when they end


# the commands that read a file a SpecError is about; another's (extend, try, ... over HTTP) is about its request
FILE_KINDS = {"run": "jobs file", "submit": "jobs file", "sweep": "sweep file"}


def main(argv: list[str] | None = None) -> int:
    """Exit 0 on success, 2 for bad usage or a bad jobs file or request, 1 for a runtime failure (a job
    failed, the cluster or service cannot be reached), 3 for a token the HTTP API refused, 4 for a request over the
    user's quota (HTTP 429, or the scheduler's refusal over Ray: the same command passes later), 130 for Ctrl-C,
    143 for SIGTERM. Errors are one line; --debug adds the traceback."""
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
            print(f"aspen: {what}; the running jobs were checkpointed, and {interrupt.then}", file=sys.stderr)
        else:
            print(f"aspen: {what}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:   # the reader of its output is gone (`aspen losses JOB | head`): not an error of aspen's
        _debug(args)
        return _pipe_closed(args)
    except SpecError as error:
        _debug(args)
        kind = FILE_KINDS.get(getattr(args, "command", None))   # another command's is a request's (HTTP 422)
        print(f"aspen: invalid {kind}:\n{error}" if kind else f"aspen: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as error:  # noqa: BLE001 - every error ends as one line (the traceback with --debug)
        _debug(args)
        code, message = _describe(error)
        print(f"aspen: {message}", file=sys.stderr)
        return code


def _pipe_closed(args: argparse.Namespace) -> int:
    """Exit 1 quietly where the pipe this process printed to was closed, as rich ends a table printed there (its
    further output, Python's last flush included, goes nowhere); a run or sweep of its own service says that it
    stopped and how it continues (its service checkpointed the running jobs as it stopped)."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):   # no file descriptor behind sys.stdout (a test's capture): nothing to flush there
        pass
    if getattr(args, "command", None) in TRAINING_COMMANDS:
        print("aspen: stopped: the pipe its output went to was closed (its reader ended); the running jobs were "
              "checkpointed, and the same command continues where they stopped (give it a file or a pipe that "
              "stays open, e.g. `| tee run.log`)", file=sys.stderr)
    return EXIT_FAILED


def _describe(error: Exception) -> tuple[int, str]:
    """The exit code and the one line for an error that ended a command."""
    from actors.service.scheduler.submissions import QuotaExceeded as QuotaRefusal  # (over Ray: the scheduler's)
    from orchestrator.http.api_client import HttpApiError, QuotaExceeded

    # the request is fine; the quota frees with time (0: an admin raises it); said alike over HTTP and over Ray
    if isinstance(error, (QuotaExceeded, QuotaRefusal)):
        wait = f"; try again in {_duration(error.retry_after)}" if error.retry_after else ""
        return EXIT_QUOTA, f"over your quota: {error}{wait}"
    if isinstance(error, HttpApiError):   # 401/403: the token (exit 3); other 4xx: the request (exit 2); 5xx or
        if error.status in (401, 403):    # no connection: the service (exit 1)
            return EXIT_REFUSED, str(error)
        return (EXIT_USAGE if 400 <= error.status < 500 else EXIT_FAILED), str(error)
    from actors.service.table.state_dir import StateDirInUse
    from actors.service.table.table_backup import JobTableDamaged
    from orchestrator.errors import ServiceError

    if isinstance(error, (ServiceError, JobTableDamaged, StateDirInUse)):   # their message is the line, with the fix
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


def _duration(seconds: float) -> str:
    """`45 s`, `12 min`, `3.5 h`."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _debug(args: argparse.Namespace) -> None:
    if getattr(args, "debug", False):
        traceback.print_exc()

