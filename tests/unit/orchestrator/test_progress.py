"""`aspen run`'s progress off a terminal (a CI log, a pipe): a line each time something changed, never the same
line again, and a job that has not started says what it waits for; `aspen status JOB` shows times as dates and
durations people read, not seconds since 1970."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time

from rich.console import Console

from orchestrator.progress import follow_jobs, record_lines
from tests.helpers.mqtt import job_record


def test_off_a_terminal_one_line_per_change_naming_what_a_job_waits_for():
    waiting = dataclasses.replace(job_record("j", "queued"), name="add", reason="waiting for a trainer of smollm2-135m",
                                  step=0, total_steps=3, loss=None)
    starting = dataclasses.replace(waiting, state="running", reason="starting on trainer-0")
    polls = [waiting] * 4 + [starting] * 3 + [dataclasses.replace(starting, step=1, loss=2.5)] * 2 + [
        dataclasses.replace(starting, step=3, loss=1.25, state="completed", reason="trained 3 of 3 steps")]
    answers = iter([[p] for p in polls])
    console = Console(file=io.StringIO(), force_terminal=False)   # not a terminal: no bars
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        final = follow_jobs(lambda: next(answers), interval=0, console=console)
    assert final[0].state == "completed"
    lines = printed.getvalue().splitlines()
    assert lines == ["add: queued (waiting for a trainer of smollm2-135m) step 0/3 loss -",
                     "add: running (starting on trainer-0) step 0/3 loss -",
                     "add: running step 1/3 loss 2.5000",
                     "add: completed step 3/3 loss 1.2500"]


def test_a_jobs_detail_shows_dates_durations_and_rounded_figures(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        submitted = 1796154732.44   # 2026-12-01 19:52:12.44 UTC
        record = dataclasses.replace(job_record("j", "completed"), name="code", step=3, total_steps=3,
                                     loss=0.9799466133117676, eval_loss=None, tokens_per_s=220.03244064203145,
                                     trainer=None, submitted_at=submitted, started_at=submitted + 0.08,
                                     finished_at=submitted + 2 * 3600 + 5 * 60 + 7, updated_at=submitted + 75.2)
        lines = record_lines(record, [(submitted, "queued", "submitted"), (submitted + 0.08, "running", "on t0")])
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    shown = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ": " in line
             and not line.startswith("    2026")}
    assert shown["steps"] == "3/3" and "step" not in shown and "total_steps" not in shown
    assert shown["loss"] == "0.9799" and shown["eval_loss"] == "-" and shown["tokens_per_s"] == "220"
    assert shown["trainer"] == "-"
    assert shown["submitted_at"] == "2026-12-01 19:52:12 UTC"
    assert shown["started_at"] == "2026-12-01 19:52:12 UTC (+0.1 s)"
    assert shown["updated_at"] == "2026-12-01 19:53:27 UTC (+1m 15s)"
    assert shown["finished_at"] == "2026-12-01 21:57:19 UTC (+2h 05m 07s)"
    assert lines[-2:] == ["    2026-12-01 19:52:12 UTC  queued         submitted",
                          "    2026-12-01 19:52:12 UTC  running        on t0"]
