"""A diverged job's NaN or infinite numbers (its loss, its grad norm) over the HTTP API: answered as strict JSON,
each such number null, rather than a 500 (Starlette's JSONResponse refuses NaN). The references: the web
console's parser, a browser's `JSON.parse` (node's, the same engine's), which refuses the NaN/Infinity tokens
Python's json would send; and `aspen losses --json --url`, the API's own Python client, printing the rows."""

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

from actors.service.table.job_table import JobRecord
from orchestrator.cli.parser import build_parser
from orchestrator.http.api import create_app
from orchestrator.service_calls import ServiceLink
from tests.helpers.http_server import running_server

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

    def aspen(*words: str) -> str:
        args: argparse.Namespace = build_parser().parse_args(list(words))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert args.handler(args) == 0
        return printed.getvalue()

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
