"""A diverged job's NaN or infinite numbers (its loss, its grad norm) over the HTTP API: answered as strict JSON,
each such number null, rather than a 500 (Starlette's JSONResponse refuses NaN). The references: the web
console's parser, a browser's `JSON.parse` (node's, the same engine's), which refuses the NaN/Infinity tokens
Python's json would send; and `aspen losses --json --url`, the API's own Python client, printing the rows.
The HTTP answer is then the reference for the CLI's `--json` output over the other transports: over Ray (the
service's Python client) and from an ended run's folder (`--from`, its job table), which printed Python's bare
NaN/Infinity tokens (refused by jq and JSON.parse) and now print the same strict JSON (orchestrator/strict_json.py)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import shutil
import subprocess
import time

import httpx
import pytest

from actors.service.table.job_table import JobRecord, JobTable
from actors.spec.job_submission import JobSubmission
from orchestrator.cli import service_commands
from orchestrator.cli.parser import build_parser
from orchestrator.http.api import create_app
from orchestrator.recent_runs import EndedRun, state_folder
from orchestrator.service_calls import ServiceLink
from tests.helpers.http_server import running_server
from tests.helpers.service import job_dict

TOKEN = "t" * 24
ROWS = [{"step": 1, "loss": 2.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "eval_loss": None, "eval_score": None,
         "time": 1.0},
        {"step": 2, "loss": math.nan, "tokens": 40, "lr": 1e-3, "grad_norm": math.inf, "eval_loss": -math.inf,
         "eval_score": None, "time": 2.0}]


def diverged(step: int = 2) -> JobRecord:
    now = time.time()
    return JobRecord(id="sft-1", name="sft", state="running", reason="", base_model="m", quantization="none",
                     priority=0, output_dir="/out", trainer="trainer-0", step=step, total_steps=10, tokens=80,
                     loss=math.nan, eval_loss=None, tokens_per_s=20.0, checkpoint_step=None, adapter_dir=None,
                     submitted_at=now, started_at=now, finished_at=None, updated_at=now)


class DivergedService:
    """A service whose one job's loss went NaN at step 2, answering as the service's Ray client does (its job a
    step further at each listing: a progress event each time)."""

    def __init__(self):
        self.listed = 0

    def jobs(self, *args, **kwargs) -> list[JobRecord]:
        self.listed += 1
        return [diverged(1 + self.listed)]

    def transitions_after(self, after, limit=None):
        return 0, []

    def status(self, key: str) -> JobRecord:
        if key not in ("sft-1", "sft"):
            raise KeyError(f"no job with id or name '{key}'")
        return diverged()

    def losses(self, job_id: str) -> list[dict]:
        return [dict(row) for row in ROWS]


@pytest.fixture
def url():
    with running_server(create_app(ServiceLink(client=DivergedService()), TOKEN, console=False)) as served:
        yield served


def aspen(*words: str) -> str:
    """The CLI's command `words`, in this process: what it printed."""
    args: argparse.Namespace = build_parser().parse_args(list(words))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert args.handler(args) == 0
    return printed.getvalue()


def strict(text: str):
    """`text` read as strict JSON: a browser's JSON.parse (node) where there is one, and Python's json refusing
    the NaN/Infinity tokens."""
    def refuse(token: str):
        raise ValueError(f"not strict JSON: {token}")

    read = json.loads(text, parse_constant=refuse)
    if shutil.which("node"):
        parsed = subprocess.run(["node", "-e", "let s='';process.stdin.on('data',d=>s+=d).on('end',()=>"
                                 "process.stdout.write(JSON.stringify(JSON.parse(s))))"],
                                input=text, capture_output=True, text=True, timeout=30)
        assert parsed.returncode == 0, parsed.stderr
        assert json.loads(parsed.stdout) == read
    return read


def test_a_diverged_jobs_losses_and_record_are_strict_json_with_null_for_nan(url):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    losses = httpx.get(f"{url}/v1/jobs/sft-1/losses", headers=headers)
    assert losses.status_code == 200, losses.text   # before: 500
    rows = strict(losses.text)
    assert rows[0]["loss"] == 2.5 and rows[0]["grad_norm"] == 0.7
    assert (rows[1]["loss"], rows[1]["grad_norm"], rows[1]["eval_loss"]) == (None, None, None)
    record = httpx.get(f"{url}/v1/jobs/sft-1", headers=headers)
    assert record.status_code == 200, record.text
    assert strict(record.text)["loss"] is None
    assert strict(httpx.get(f"{url}/v1/jobs", headers=headers).text)[0]["loss"] is None


def test_aspen_losses_over_url_prints_the_diverged_step(url, monkeypatch):
    monkeypatch.setenv("ASPEN_TOKEN", TOKEN)

    rows = json.loads(aspen("losses", "sft", "--json", "--url", url))
    assert [(row["step"], row["loss"]) for row in rows] == [(1, 2.5), (2, None)]
    table = aspen("losses", "sft", "--url", url).splitlines()
    assert table[2].split()[:2] == ["2", "-"]


def test_the_event_stream_s_snapshot_and_progress_events_are_strict_json(url):
    """The console reads each event's data with JSON.parse (orchestrator/console/static/js/api.js); FastAPI's
    server-sent events already send NaN as null (pydantic's JSON), as the API's other answers now do."""
    events: dict[str, dict] = {}
    with httpx.stream("GET", f"{url}/v1/events?progress=true", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=30) as stream:
        name = None
        for line in stream.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events[name] = strict(line.split(":", 1)[1].strip())
            if "snapshot" in events and "progress" in events:
                break
    assert events["snapshot"]["jobs"][0]["loss"] is None
    assert events["progress"]["loss"] is None and events["progress"]["job"] == "sft-1"


class RayLike(DivergedService):
    """The diverged service as the CLI's Ray client answers it (Python floats, NaN and inf as they are)."""

    def transitions(self, job_id: str) -> list[tuple[float, str, str]]:
        return [(1.0, "queued", "submitted"), (2.0, "running", "")]


def without(rows, *keys: str):
    """`rows` (a list of dicts or one) less `keys`."""
    if isinstance(rows, list):
        return [without(row, *keys) for row in rows]
    return {key: value for key, value in rows.items() if key not in keys}


def over_http(client, path: str):
    with running_server(create_app(ServiceLink(client=client), TOKEN, console=False)) as url:
        answer = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.text
    return strict(answer.text)


@pytest.mark.parametrize("command", [("losses", "sft"), ("status", "sft"), ("status",)])
def test_over_ray_the_json_output_is_the_http_answer_strict(monkeypatch, command):
    monkeypatch.setenv("ASPEN_TOKEN", TOKEN)
    monkeypatch.setattr(service_commands, "connect_service", lambda args: RayLike())
    printed = strict(aspen(*command, "--json"))   # before: ValueError, not strict JSON: NaN
    path = {("losses", "sft"): "/v1/jobs/sft/losses", ("status", "sft"): "/v1/jobs/sft",
            ("status",): "/v1/jobs"}[command]
    reference = over_http(RayLike(), path)
    if command == ("status", "sft"):
        assert printed.pop("history") == [{"time": 1.0, "state": "queued", "reason": "submitted"},
                                          {"time": 2.0, "state": "running", "reason": ""}]
        assert printed["loss"] is None
    if command == ("losses", "sft"):
        assert [(row["step"], row["loss"], row["grad_norm"]) for row in printed] == [(1, 2.5, 0.7), (2, None, None)]
    # a record's clock and its step move at each listing of this service (the time it is asked)
    assert without(printed, "updated_at", "submitted_at", "started_at", "step") == \
        without(reference, "updated_at", "submitted_at", "started_at", "step")


class ServedRun(EndedRun):
    """The ended run's table behind the HTTP API (its listing takes the service's filters: none here)."""

    def jobs(self, *filters) -> list:
        return super().jobs()


def diverged_run(tmp_path):
    """An ended run's folder whose one job diverged: its loss infinite at step 2, its eval loss -inf."""
    out = tmp_path / "out"
    table = JobTable(state_folder(out) / "jobs.sqlite")
    submission = JobSubmission.model_validate({"job": job_dict("sft", tmp_path / "d.jsonl", 4),
                                               "base_model": "smollm2-135m"})
    job_id = table.add("sft-1", submission, out / "sft").id
    table.progress.add(job_id, {"step": 1, "loss": 2.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7})
    table.progress.add(job_id, {"step": 2, "loss": math.inf, "tokens": 40, "lr": 1e-3, "grad_norm": math.inf})
    table.progress.add_eval(job_id, 2, -math.inf, None)
    table.update(job_id, loss=math.inf, step=2)
    table.close()
    return out


@pytest.mark.parametrize("command", [("losses", "sft"), ("status", "sft"), ("status",)])
def test_from_a_runs_folder_the_json_output_is_the_http_answer_strict(tmp_path, command):
    out = diverged_run(tmp_path)
    printed = strict(aspen(*command, "--json", "--from", str(out)))   # before: Infinity tokens
    path = {("losses", "sft"): "/v1/jobs/sft/losses", ("status", "sft"): "/v1/jobs/sft-1",
            ("status",): "/v1/jobs"}[command]
    reference = over_http(ServedRun(state_folder(out)), path)
    if command == ("status", "sft"):
        assert [entry["state"] for entry in printed.pop("history")] == ["queued"]
    assert printed == reference
    if command == ("losses", "sft"):
        assert [(row["step"], row["loss"], row["eval_loss"]) for row in printed] == [(1, 2.5, None),
                                                                                     (2, None, None)]


def test_the_table_shows_an_infinite_loss_as_inf_not_as_missing(tmp_path):
    lines = aspen("losses", "sft", "--from", str(diverged_run(tmp_path))).splitlines()
    assert lines[2].split()[:3] == ["2", "inf", "-inf"], lines


def test_a_nan_loss_survives_the_job_table_and_reads_back_as_nan_not_as_missing(tmp_path):
    """A NaN, an infinite and a missing loss written through the table's own write path, read back after the
    table is closed (a restarted service, an ended run's folder): the CLI's table tells the four apart, read by
    Python's float (before, the NaN step showed `-` as the missing one: SQLite stores a float NaN as NULL);
    `--json` and the HTTP API send each non-finite one as null (strict JSON, docs/http.md)."""
    out = tmp_path / "out"
    table = JobTable(state_folder(out) / "jobs.sqlite")
    submission = JobSubmission.model_validate({"job": job_dict("sft", tmp_path / "d.jsonl", 4),
                                               "base_model": "smollm2-135m"})
    job_id = table.add("sft-1", submission, out / "sft").id
    for step, loss in enumerate((2.5, math.nan, math.inf, -math.inf, None), start=1):
        table.progress.add(job_id, {"step": step, "loss": loss, "tokens": 40, "lr": 1e-3, "grad_norm": loss})
    table.progress.add_eval(job_id, 2, math.nan)
    table.update(job_id, loss=math.nan, step=5)
    table.close()

    lines = aspen("losses", "sft", "--from", str(out)).splitlines()[1:]
    shown = [float(line.split()[1]) if line.split()[1] != "-" else None for line in lines]
    assert shown[0] == 2.5 and math.isnan(shown[1]) and shown[4] is None, lines
    assert math.isinf(shown[2]) and shown[2] > 0 and math.isinf(shown[3]) and shown[3] < 0, lines
    assert math.isnan(float(lines[1].split()[2])) and math.isnan(float(lines[1].split()[-2])), lines   # eval, grad
    reopened = JobTable(state_folder(out) / "jobs.sqlite")
    assert math.isnan(reopened.get(job_id).loss)
    reopened.close()

    printed = strict(aspen("losses", "sft", "--json", "--from", str(out)))
    assert printed == over_http(ServedRun(state_folder(out)), "/v1/jobs/sft/losses")
    assert [row["loss"] for row in printed] == [2.5, None, None, None, None]
    assert strict(aspen("status", "sft", "--json", "--from", str(out)))["loss"] is None
