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


BRACKETS = "data /srv/[v2]/rows.jsonl: row 3 ends with [/INST] [bold]"   # rich would take these for markup


def _shown(renderable, width: int = 400) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    console.print(renderable)
    return " ".join(console.file.getvalue().split())


def test_text_with_square_brackets_is_shown_as_written_not_taken_for_markup(tmp_path, monkeypatch):
    """A reason, a path, a prompt or a prediction holding `[...]` (a folder `[v2]`, a chat template's `[/INST]`) is
    shown as it is by every table and progress line: rich would drop `[v2]` and `[bold]` as styles, and fail on
    `[/INST]` (a closing tag with nothing to close)."""
    import argparse

    from orchestrator.cli import service_commands
    from orchestrator.progress import summary_table
    from orchestrator.report import write_report
    from orchestrator.watch import jobs_table

    record = dataclasses.replace(job_record("j", "queued"), name="j", reason=BRACKETS, step=0)
    assert BRACKETS in _shown(summary_table([record], title="2 jobs on /models/[v2]"))
    assert "2 jobs on /models/[v2]" in _shown(summary_table([record], title="2 jobs on /models/[v2]"))
    assert BRACKETS in _shown(jobs_table([record]))
    # `aspen run`'s live bars on a terminal: the state column holds a waiting job's reason
    console = Console(file=io.StringIO(), width=400, force_terminal=True)
    ended = dataclasses.replace(record, state="failed", step=1)
    answers = iter([[record], [record], [ended]])
    follow_jobs(lambda: next(answers), interval=0, console=console)
    assert "[/INST]" in console.file.getvalue()
    # `aspen report` of a run whose folder is named with brackets
    run = tmp_path / "[v2]"
    (run / "job").mkdir(parents=True)
    (run / "job" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "tokens": 10}\n')
    printed = Console(file=io.StringIO(), width=400)
    write_report(run, console=printed)
    assert f"1jobsin{run}" in "".join(printed.file.getvalue().split())   # the title wraps at the table's width
    # `aspen generations`: a prompt and a prediction in a chat template
    found = {"steps": [2], "step": 2, "rows": [{"step": 2, "row": 0, "prompt": "<s>[INST] 2+2? [/INST]",
                                                "reference": "[4]", "prediction": "[bold]4[/bold] [/INST]",
                                                "score": 1.0},
                                               {"step": 2, "row": 1, "prompt": "HEAD" + "p" * 900 + "TAIL",
                                                "reference": "r", "prediction": "START" + "q" * 900 + "END",
                                                "score": 0.0}]}

    class Answers:
        @staticmethod
        def generations(job, step):
            return found

    monkeypatch.setattr(service_commands, "_service_or_ended_run", lambda args: Answers())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert service_commands.cmd_generations(argparse.Namespace(job="j", step=None, json=False)) == 0
    text = printed.getvalue()
    assert "<s>[INST] 2+2? [/INST]" in text and "[bold]4[/bold] [/INST]" in text and "[4]" in text
    # a long prompt shows its end (what the adapter continued), a long prediction its start; --json has them whole
    shown = []
    monkeypatch.setattr("orchestrator.progress.print_table", shown.append)
    with contextlib.redirect_stdout(io.StringIO()):
        service_commands.cmd_generations(argparse.Namespace(job="j", step=None, json=False))
    cells = {column.header: list(column.cells) for column in shown[0].columns}
    assert cells["prompt"][1] == "..." + ("p" * 900 + "TAIL")[-400:]
    assert cells["prediction"][1] == ("START" + "q" * 900)[:400] + "..."


class FleetService:
    """The scheduler's info() / wait_ready() over the real fleet."""

    def __init__(self, fleet):
        self.fleet = fleet

    def info(self):
        return {"trainers": self.fleet.describe()}

    def wait_ready(self, timeout, nodes_may_join=False):
        if not self.fleet.all_settled():
            raise TimeoutError(f"trainers not ready after {timeout:.0f}s")
        return self.info()


def test_waiting_for_trainers_says_a_retired_one_once_and_does_not_wait_for_it(tmp_path):
    """A trainer whose node left the cluster is retired (the real fleet's `info()`, its loss not yet booked: the
    job table locked). `aspen run` printed 'trainer-1: retired' and waited until it was dropped (its whole timeout
    where the table stayed locked); now it says so once and goes on with the ready trainer."""
    from orchestrator.progress import wait_for_trainers
    from tests.helpers.fleet_fakes import HEAD, WORKER, FakeCluster, bring_up, fleet_with

    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, _ = fleet_with(tmp_path, cluster, trainer="trainer-1")
    bring_up(fleet, cluster)
    cluster.live = [HEAD]
    fleet.follow(cluster.nodes())             # the worker left: trainer-1 retired, its events not yet booked
    assert "trainer-1" in fleet.slots

    out = io.StringIO()
    began = time.monotonic()
    info = wait_for_trainers(FleetService(fleet), interval=0.01, timeout=3, out=out)
    assert time.monotonic() - began < 1
    assert out.getvalue().splitlines() == ["trainer-1: retired"]
    assert [(t["id"], t["phase"]) for t in info["trainers"]] == [("trainer-0", "ready"), ("trainer-1", "retired")]


def test_a_failed_trainer_beside_a_retired_one_is_no_trainer_that_could_start(tmp_path):
    """trainer-0 cannot load its base, trainer-1's node left (retired): `Client.wait_ready` (what `aspen run` waits
    with) answered as if a trainer were up, and the jobs then waited for none; now it says no trainer could start
    and why. The fleet's real `info()`; the client's own check."""
    import pytest

    from actors.service.scheduler.trainer_fleet import TrainerCallFailed
    from orchestrator.client import Client
    from orchestrator.errors import ServiceError
    from orchestrator.progress import wait_for_trainers
    from tests.helpers.fleet_fakes import HEAD, WORKER, FakeCluster, fleet_with

    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, _ = fleet_with(tmp_path, cluster)
    cluster.current("trainer-0").ready.fail(TrainerCallFailed("RayTaskError", OSError("no such model: x")))
    cluster.live = [HEAD]
    cluster.current("trainer-1").ready.fail(TrainerCallFailed("RayActorError", "its node died"))
    fleet.watch_all()
    client = object.__new__(Client)   # its scheduler: the fleet (no Ray)
    client._request = lambda method, *args, **kwargs: {"trainers": fleet.describe()}
    with pytest.raises(ServiceError, match="no trainer could start: trainer-0: could not start: no such model: x"):
        wait_for_trainers(client, interval=0.01, timeout=3, out=io.StringIO())


def test_waiting_for_trainers_ends_where_one_cannot_be_placed_and_goes_on_with_the_others(tmp_path, capsys):
    """A trainer no node of the cluster holds (it asks a GPU, no node has one), with no autoscaler that may add one:
    `aspen run` and `aspen serve` waited in wait_ready for it until its timeout (600 s). Now the wait ends once it is
    said: beside a ready trainer it is said on stderr and the others go on; alone, no trainer could start, and
    `Client.wait_ready` says why (the fleet's real info(), the client's own check)."""
    import pytest

    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.placement_waits import PLACEMENT_WAIT_S
    from orchestrator.client import Client
    from orchestrator.errors import ServiceError
    from orchestrator.progress import wait_for_trainers
    from tests.helpers.fleet_fakes import HEAD, WORKER, FakeCluster, fleet_with
    from tests.helpers.scheduler_fakes import status

    cluster = FakeCluster(HEAD, WORKER)
    kinds = [TrainerConfig(nodes="any"), TrainerConfig(nodes="any", base_model="qwen2.5-0.5b", num_gpus=1)]
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=kinds)
    cluster.current("trainer-0").ready.give(status("trainer-0"))
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    client = object.__new__(Client)   # its scheduler: the fleet (no Ray), settled as the scheduler's wait_ready asks

    def answer(method, *args, **kwargs):
        assert method == "info" or fleet.all_settled(), "wait_ready would wait for its timeout"
        return {"trainers": fleet.describe()}

    client._request = answer
    out = io.StringIO()
    began = time.monotonic()
    info = wait_for_trainers(client, interval=0.01, timeout=3, out=out)
    assert time.monotonic() - began < 1
    assert [t["ready"] for t in info["trainers"]] == [True, False] and out.getvalue() == ""
    warning = capsys.readouterr().err
    assert warning.startswith("aspen: warning: trainer-1 (qwen2.5-0.5b) does not run: waiting for a node: no node of "
                              "the cluster has a GPU"), warning
    assert warning.rstrip().endswith("going on with the trainers that started (jobs of its base wait, their reason "
                                     "saying why)"), warning
    del fleet.slots["trainer-0"]   # the unplaceable one alone
    alone = r"no trainer could start: trainer-1: waiting for a node: no node of the cluster has a GPU: .* or ask"
    with pytest.raises(ServiceError, match=alone + r" for less: device: cpu or auto in a jobs file"):
        wait_for_trainers(client, interval=0.01, timeout=3, out=io.StringIO())


def test_a_trainer_waiting_for_a_node_the_autoscaler_may_add_is_said_once_and_waited_for(tmp_path):
    """Where the cluster's autoscaler may add a node that holds the trainer, the wait goes on (it may start), its
    reason printed once as a progress line, not silence and not a line a poll."""
    import pytest

    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.placement_waits import PLACEMENT_WAIT_S
    from orchestrator.progress import wait_for_trainers
    from tests.helpers.fleet_fakes import HEAD, WORKER, FakeCluster, fleet_with

    cluster = FakeCluster(HEAD, WORKER)
    cluster.autoscaler = "may_grow"
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_gpus=1))
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()

    out = io.StringIO()
    with pytest.raises(TimeoutError):
        wait_for_trainers(FleetService(fleet), interval=0.01, timeout=0.5, out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "trainer-0: waiting for a node: no node of the cluster has a GPU: device: cuda (or num_gpus) asks for one per "
        "trainer; the cluster's autoscaler may add such a node: waiting for it; else add a node"), lines
