"""Showing jobs to people: a live progress bar per job (loss, tokens/s) and the final summary table."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from actors.service.table.job_record import best_text
from actors.service.table.job_table import TERMINAL_STATES, JobRecord


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def _state(record: JobRecord) -> str:
    """A job's state, with what it waits for while it has not started."""
    if record.reason and (record.state in ("queued", "paused") or (record.state == "running" and not record.step)):
        return f"{record.state} ({record.reason})"
    return record.state


def follow_jobs(fetch: Callable[[], list[JobRecord]], *, quiet: bool = False, interval: float = 0.5,
                timeout: float | None = None, console: Console | None = None) -> list[JobRecord]:
    """Poll `fetch` until every job has ended, showing a progress bar per job; when the output is not a
    terminal, a plain line each time something changed (a state, a step, what a waiting job waits for), never the
    same line twice. A job that is not running yet shows why (loading the base, waiting for a trainer, ...).
    Returns the final records."""
    console = console or Console(stderr=False)
    deadline = None if timeout is None else time.time() + timeout
    live = console.is_terminal and not quiet
    columns = [TextColumn("{task.description:<20}", markup=False), BarColumn(), MofNCompleteColumn(),   # text
               TextColumn("loss {task.fields[loss]:>7}  {task.fields[speed]:>8} tok/s  {task.fields[state]}",
                          markup=False), TimeElapsedColumn()]   # as it is: a reason may hold [/x], not markup
    last_line = ""
    with Progress(*columns, console=console, disable=not live) as progress:
        tasks: dict[str, int] = {}
        while True:
            records = fetch()
            for r in records:
                fields = {"loss": _fmt(r.loss), "speed": _fmt(r.tokens_per_s, ".0f"), "state": _state(r)}
                if r.id not in tasks:
                    tasks[r.id] = progress.add_task(r.name, total=r.total_steps or 1, **fields)
                progress.update(tasks[r.id], completed=r.step, total=r.total_steps or max(r.step, 1), **fields)
            if not live and not quiet:
                line = "  ".join(f"{r.name}: {_state(r)} step {r.step}/{r.total_steps or '?'} loss {_fmt(r.loss)}"
                                 for r in records)
                if line != last_line:
                    last_line = line
                    print(line, flush=True)
            if records and all(r.state in TERMINAL_STATES for r in records):
                return records
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"jobs still running after {timeout}s")
            time.sleep(interval)


def wait_for_trainers(client, *, quiet: bool = False, interval: float = 0.5, timeout: float = 600,
                      out=None, warn: bool = True, nodes_may_join: bool = False) -> dict:
    """Wait until every trainer of the service has set up (or failed to), printing what each is doing when it
    changes (loading the base, converting a GGUF file once, warming up, measuring memory, waiting for a node the
    cluster's autoscaler may add): a start of a minute is not silent. A retired trainer (its node left the cluster)
    is said once and not waited for: it never starts again (a node that joins gets a new one); nor is one known
    unplaceable (no node holds it, no autoscaler may add one). Returns the service's info, as `client.wait_ready`
    does (which raises where no trainer could start; with `nodes_may_join`, only where each failed), having said on
    stderr (unless not `warn`) each trainer that failed or cannot be placed while others did start: their jobs wait,
    their reason saying why."""
    out = out or sys.stdout
    deadline = time.time() + timeout
    shown: dict[str, str] = {}
    while time.time() < deadline:
        trainers = client.info()["trainers"]
        for trainer in trainers:
            phase = trainer.get("phase") or "starting its process"
            if not quiet and shown.get(trainer["id"]) != phase and phase not in ("ready", "failed") \
                    and not trainer.get("unplaceable"):   # said below, or in wait_ready's error
                print(f"{trainer['id']}: {phase}", file=out, flush=True)
            shown[trainer["id"]] = phase
        if all(t.get("ready") or t.get("error") or t.get("retired") or t.get("unplaceable") for t in trainers):
            break
        time.sleep(interval)
    info = client.wait_ready(timeout=max(deadline - time.time(), 1), nodes_may_join=nodes_may_join)
    for trainer in info["trainers"]:
        if warn and (trainer.get("error") or trainer.get("unplaceable")) and not trainer.get("retired"):
            print(f"aspen: warning: {trainer['id']} ({trainer['base_model']}) does not run: "
                  f"{trainer['error'] or trainer['phase']}; going on with the trainers that started (jobs of its base "
                  "wait, their reason saying why)", file=sys.stderr, flush=True)
    return info


def summary_table(records: list[JobRecord], title: str = "jobs") -> Table:
    table = Table(title=escape(title))   # a base's path may hold [...]: text, not markup
    scored = any(r.eval_score is not None for r in records)   # a job with an eval_generate metric
    kept = any(r.best is not None for r in records)   # a keep_best job evaluated: the step whose adapter it keeps
    for column in ("job", "id", "state", "steps", "tokens", "loss", "eval loss", *(["eval score"] if scored else []),
                   *(["best (kept)"] if kept else []), "reason"):
        table.add_column(column, justify="left" if column in ("job", "id", "state", "best (kept)", "reason")
                         else "right")
    for r in records:
        table.add_row(r.name, r.id, r.state, f"{r.step}/{r.total_steps or '?'}", str(r.tokens), _fmt(r.loss),
                      _fmt(r.eval_loss), *([_fmt(r.eval_score)] if scored else []),
                      *([best_text(r.best)] if kept else []), escape(r.reason))
    return table


def _when(moment: float | None, since: float | None = None) -> str:
    """A time as people read it (local, to the second), with how long after `since` it came."""
    if moment is None:
        return "-"
    shown = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(moment))
    return shown if since is None else f"{shown} (+{_duration(moment - since)})"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def record_lines(record: JobRecord, transitions: list[tuple[float, str, str]]) -> list[str]:
    """One job in detail for `aspen status JOB`: each field of its record, times as local dates (each after the
    submission by how long), figures to four significant digits (a keep_best job's `best`: the evaluation whose
    adapter it keeps), then its state history (`--json` has the raw values)."""
    start = record.submitted_at
    readable = {"step": ("steps", f"{record.step}/{record.total_steps or '?'}"),
                "loss": ("loss", _fmt(record.loss, ".4g")), "eval_loss": ("eval_loss", _fmt(record.eval_loss, ".4g")),
                "eval_score": ("eval_score", _fmt(record.eval_score, ".4g")),
                "best": ("best", None if record.best is None else best_text(record.best) + (
                    " (the adapter it ended with)" if record.state in ("completed", "stopped_early")
                    else " (its best so far)")),
                "tokens_per_s": ("tokens_per_s", _fmt(record.tokens_per_s, ".4g")),
                "submitted_at": ("submitted_at", _when(record.submitted_at)),
                **{key: (key, _when(getattr(record, key), start))
                   for key in ("started_at", "finished_at", "updated_at")}}
    lines = []
    for key, value in record.as_dict().items():
        if key != "total_steps":
            key, value = readable.get(key, (key, value))
            lines.append(f"{key:>16}: {'-' if value is None else value}")
    lines.append("\n  history:")
    lines += [f"    {_when(when)}  {state:<14} {reason}" for when, state, reason in transitions]
    return lines


def quiet_loading_bars(quiet: bool = False) -> None:
    """transformers' bars as it loads or writes a model, off for --quiet or where stderr is not a terminal (a log
    would get each redraw as a line)."""
    if quiet or not sys.stderr.isatty():
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def print_table(table: Table) -> None:
    Console(width=max(Console().width, 140) if not sys.stdout.isatty() else None).print(table)


def warn_policy_replaced(info: dict) -> None:
    """Say on stderr that the service's policy failed and FIFO scheduled the jobs since (its info's `policy_error`),
    which `aspen run` said nothing of: a policy author saw their jobs trained and took it for their policy's work;
    and what the policy asked that was not done, or the rounds it overran (`policy_warnings`)."""
    for warning in info.get("policy_warnings", ()):
        print(f"aspen: warning: {warning}", file=sys.stderr)
    if info.get("policy_error"):
        print(f"aspen: warning: the jobs file's scheduling policy was not used: {info['policy_error']}, so FIFO "
              "scheduled these jobs (the service's log holds the traceback); fix the policy (`python -m "
              "orchestrator.simulator.simulate TRACE --policies fifo,YOURS` runs it without a model) and run again",
              file=sys.stderr)
