"""`aspen watch`: a live table of the service's jobs (state, step, loss, tokens/s, ETA), refreshed every
second from the service's job table, or printed once (`--once`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

from actors.core.job_table import JobRecord


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def eta_seconds(record: JobRecord, now: float | None = None) -> float | None:
    """Seconds until a running job reaches its total steps: from its tokens/s and tokens per step, else
    from its steps per second since it started. None when it is not running or nothing is measured yet."""
    if record.state != "running" or not record.total_steps or not record.step:
        return None
    remaining = max(record.total_steps - record.step, 0)
    if record.tokens_per_s and record.tokens:
        return remaining * (record.tokens / record.step) / record.tokens_per_s
    if record.started_at:
        elapsed = (now or time.time()) - record.started_at
        if elapsed > 0:
            return remaining / (record.step / elapsed)
    return None


def jobs_table(records: list[JobRecord], now: float | None = None, title: str | None = None) -> Table:
    table = Table(title=title or f"aspen jobs ({time.strftime('%H:%M:%S', time.localtime(now or time.time()))})")
    for column, right in (("job", False), ("state", False), ("step", True), ("loss", True), ("eval loss", True),
                          ("tokens/s", True), ("ETA", True), ("reason", False)):
        table.add_column(column, justify="right" if right else "left", overflow="fold")
    for r in records:
        eta = eta_seconds(r, now)
        table.add_row(r.id, r.state, f"{r.step}/{r.total_steps or '?'}", _fmt(r.loss), _fmt(r.eval_loss),
                      _fmt(r.tokens_per_s, ".0f") if r.state == "running" else "-",
                      format_duration(eta) if eta is not None else "-", r.reason)
    return table


def watch(fetch: Callable[[], list[JobRecord]], *, once: bool = False, interval: float = 1.0,
          console: Console | None = None, duration: float | None = None) -> list[JobRecord]:
    """Show the jobs `fetch` returns: once, or live every `interval` seconds until Ctrl-C (or `duration`
    seconds). Returns the last records fetched."""
    console = console or Console()
    records = fetch()
    if once:
        console.print(jobs_table(records))
        return records
    deadline = None if duration is None else time.time() + duration
    with Live(jobs_table(records), console=console, refresh_per_second=4) as live:
        try:
            while deadline is None or time.time() < deadline:
                time.sleep(interval)
                records = fetch()
                live.update(jobs_table(records))
        except KeyboardInterrupt:
            pass
    return records
