"""Where a keep_best job's kept evaluation is shown: its job record's `best` {metric, step, value} (set as its
evaluations improve, carried over a resume, final at its end: the same as its adapter folder's aspen.json), in
`aspen status` (JSON, the table and the detail), the HTTP API's job record, `aspen generations` (which step is kept
and where its generations are) and `aspen report` (the kept adapter's evaluation). The reference for each value is
the eval loss the job's metrics.jsonl recorded at that step."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from actors.service.events.event_booking import EventBooking
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduling_state import SchedulingStates
from actors.service.table.job_record import adapter_step
from actors.service.table.job_table import JobRecord, JobTable
from orchestrator.cli import service_commands
from orchestrator.cli.parser import build_parser
from orchestrator.http.api import create_app
from orchestrator.progress import record_lines, summary_table
from orchestrator.recent_runs import EndedRun
from orchestrator.report import collect, markdown_table, report_data
from orchestrator.service_calls import ServiceLink
from orchestrator.watch import jobs_table
from tests.helpers.keep_best import eval_losses, overfitting_job, paused_then_resumed
from tests.helpers.service import run_spec

TOKEN = "t" * 32
SCORED = {"metric": "tests.helpers.metrics:recorded", "max_new_tokens": 6}


def running_best(losses: dict[int, float]) -> dict[int, dict]:
    """Step -> the best evaluation up to that step (the lowest eval loss, the first of equal ones), from the
    job's metrics: what its record should show after that step's evaluation."""
    best, shown = None, {}
    for step in sorted(losses):
        if best is None or losses[step] < best["value"]:
            best = {"metric": "eval_loss", "step": step, "value": losses[step]}
        shown[step] = best
    return shown


def test_the_job_record_shows_the_best_evaluation_so_far_through_a_resume_to_its_end(tmp_path, memorising_model):
    """Each trainer event booked into a job table as the service books it: after each evaluation the record's
    `best` is the best eval loss so far (None before the first); paused after its best and resumed in a new
    trainer, the record's best is its checkpoint's; at its end it is its aspen.json's `best`."""
    job = overfitting_job(tmp_path / "data", 20, keep_best="eval_loss")
    first, second = paused_then_resumed(tmp_path, memorising_model, job, 14)
    (submission,) = run_spec(str(memorising_model), tmp_path / "paused", [job]).submissions()
    table = JobTable(tmp_path / "table" / "jobs.sqlite")
    table.add("fit-1", submission, tmp_path / "paused" / "fit")
    booking = EventBooking(table, SchedulingStates())
    shown: list[tuple[str, int, dict | None]] = []
    for trainer, events in (("trainer-t", first), ("trainer-u", second)):
        for event in events:
            with table.transaction():
                booking.apply_event(trainer, event)
            if event.kind != "progress":
                shown.append((event.kind, event.step, table.get("fit-1").best))
    expected = running_best(eval_losses(tmp_path / "paused" / "fit"))
    best_step = expected[20]["step"]
    assert 2 < best_step < 14, expected   # it improved, then stopped improving before the pause
    evals = [(step, best) for kind, step, best in shown if kind == "eval"]
    assert [step for step, _ in evals] == sorted(expected), shown   # every evaluation was booked
    assert all(best == expected[step] for step, best in evals), (evals, expected)
    kinds = [(kind, step) for kind, step, _ in shown]
    assert kinds[0] == ("started", 0) and shown[0][2] is None
    assert ("paused", 14) in kinds and ("started", 14) in kinds
    assert shown[kinds.index(("started", 14))][2] == expected[14]   # from its checkpoint, in the new trainer
    end_kind, end_step, end_best = shown[-1]
    assert end_kind == "completed" and end_step == 20
    facts = json.loads((tmp_path / "paused" / "fit" / "aspen.json").read_text())
    assert end_best == facts["best"] == expected[20]
    table.close()


@pytest.fixture(scope="module")
def ended_run(tmp_path_factory, memorising_model) -> Path:
    """An in-process run (as `aspen run --in-process` records it, its table in .aspen) of an overfitting job
    that keeps its lowest eval loss and writes its generations at each evaluation."""
    folder = tmp_path_factory.mktemp("kept")
    job = overfitting_job(folder / "data", 20, keep_best="eval_loss", eval_generate=SCORED)
    train_locally(run_spec(str(memorising_model), folder / "out", [job]), progress=False,
                  record_in=folder / "out" / ".aspen")
    return folder / "out"


def kept_facts(out: Path) -> dict:
    """The job's aspen.json `best`, checked against its metrics: the lowest eval loss, at a step before its last."""
    best = json.loads((out / "fit" / "aspen.json").read_text())["best"]
    losses = eval_losses(out / "fit")
    assert best == running_best(losses)[max(losses)] and best["step"] < max(losses), (best, losses)
    return best


def aspen(*words: str) -> str:
    """What an aspen command prints (its exit status 0)."""
    args = build_parser().parse_args(list(words))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert args.handler(args) == 0
    return printed.getvalue()


def test_aspen_status_shows_the_kept_evaluation_in_json_the_table_and_the_detail(ended_run):
    best = kept_facts(ended_run)
    shown = f"eval loss {best['value']:.4g} at step {best['step']}"
    assert json.loads(aspen("status", "fit", "--json", "--from", str(ended_run)))["best"] == best
    assert [record["best"] for record in json.loads(aspen("status", "--json", "--from", str(ended_run)))] == [best]
    record = EndedRun(ended_run / ".aspen").status("fit")
    assert f"            best: {shown} (the adapter it ended with)" in record_lines(record, [])
    unkept = JobRecord(**{**record.as_dict(), "best": None})   # a job without keep_best: no column
    for table in (summary_table, jobs_table):   # aspen status, aspen watch
        cells = {column.header: list(column.cells) for column in table([record, unkept]).columns}
        assert cells["best (kept)"] == [shown, "-"]
        assert "best (kept)" not in [column.header for column in table([unkept]).columns]


def test_try_it_names_the_step_of_the_adapter_a_keep_best_job_ended_with(ended_run):
    """"Try it" on an ended job runs the adapter in its folder and names its step: a keep_best job's kept one, as its
    aspen.json says (it named the job's last step, whose adapter is in its checkpoint only)."""
    best = kept_facts(ended_run)
    record = EndedRun(ended_run / ".aspen").status("fit")
    folder_step = json.loads((Path(record.adapter_dir) / "aspen.json").read_text())["step"]
    assert adapter_step(record) == folder_step == best["step"] < record.step
    unkept = JobRecord(**{**record.as_dict(), "best": None})
    assert adapter_step(unkept) == record.step


class EndedService(EndedRun):
    """The ended run's table answering the HTTP API's calls as the service's Ray client does."""

    def jobs(self, states: list[str] | None = None, limit: int | None = None, after: str | None = None,
             owner: str | None = None) -> list[JobRecord]:   # as Client.jobs (one page: this run has one job)
        found = [record for record in super().jobs() if (not states or record.state in states)
                 and (owner is None or record.user == owner) and after is None]
        return found[:limit]


def test_the_http_api_serves_the_kept_evaluation_with_the_job_and_its_generations(ended_run):
    best = kept_facts(ended_run)
    http = TestClient(create_app(ServiceLink(client=EndedService(ended_run / ".aspen")), TOKEN, console=False))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    record = http.get("/v1/jobs/fit", headers=headers).json()
    assert record["best"] == best and JobRecord(**record).best == best   # as the HttpClient reads it
    assert [job["best"] for job in http.get("/v1/jobs", headers=headers).json()] == [best]
    generations = http.get("/v1/jobs/fit/generations", headers=headers).json()
    assert generations["best"] == best and best["step"] in generations["steps"]


def test_aspen_generations_names_the_kept_step_and_where_its_generations_are(ended_run, monkeypatch):
    best = kept_facts(ended_run)
    kept = f"fit keeps the adapter of its best evaluation, eval loss {best['value']:.4g} at step {best['step']}"
    last = aspen("generations", "fit", "--from", str(ended_run))
    assert "the evaluation after step 20" in last
    assert f"{kept}; its generations: aspen generations fit --step {best['step']}" in last
    assert f"{kept}: these are its generations" in aspen("generations", "fit", "--step", str(best["step"]),
                                                         "--from", str(ended_run))
    assert json.loads(aspen("generations", "fit", "--json", "--from", str(ended_run)))["best"] == best

    class NoGenerations:   # a keep_best job without eval_generate: its kept step has none
        @staticmethod
        def generations(job, step):
            return {"steps": [], "step": None, "rows": [], "best": best}

    monkeypatch.setattr(service_commands, "_service_or_ended_run", lambda args: NoGenerations())
    assert f"{kept}; no generations were recorded after step {best['step']}" in aspen("generations", "fit")


def test_aspen_report_names_the_kept_adapters_evaluation(ended_run):
    best = kept_facts(ended_run)
    (data,) = report_data(collect(ended_run))
    assert data["kept"] == best and data["state"] == "completed"
    table = markdown_table(collect(ended_run))
    assert table.splitlines()[0].endswith("| kept adapter |")
    assert table.splitlines()[2].endswith(f"| completed | eval loss {best['value']:.4g} at step {best['step']} |")
