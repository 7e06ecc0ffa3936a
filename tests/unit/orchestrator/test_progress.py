"""`aspen run`'s progress off a terminal (a CI log, a pipe): a line each time something changed, never the same
line again, and a job that has not started says what it waits for."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from rich.console import Console

from orchestrator.progress import follow_jobs
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
