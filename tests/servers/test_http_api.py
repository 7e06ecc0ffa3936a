"""The HTTP API (orchestrator/http/api.py) on a real uvicorn server on a loopback port, over a real service on
the session's Ray, driven with real HTTP requests: the Ray-free client (orchestrator/http/api_client.py) and raw
httpx. What it answers is checked against the Ray client's view of the same service (the reference), and
every refused request (no or a wrong token, malformed or invalid bodies, unknown jobs, duplicates,
oversized bodies) is checked to leave the job table exactly as it was."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from actors.checkpoint.adapter_export import export_adapter
from actors.service.accounts.audit import AuditLog
from actors.service.accounts.users import UserBook
from actors.service.scheduler.config import ServiceConfig, TrainerConfig
from orchestrator.client import Client
from orchestrator.http import jobs as http_jobs
from orchestrator.http.api import ServiceLink, create_app
from orchestrator.http.api_client import Conflict, HttpClient, JobNotFound, SpecRefused, Unauthorized
from orchestrator.http.bridge import ProcessLink
from orchestrator.http.token import TokenFileError, client_token, ensure_token, read_token
from tests.helpers.http_server import NOBODYS_MODEL, running_server
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, wait_for, write_task_data

REPO = Path(__file__).resolve().parents[2]
BODY_LIMIT = 64 * 1024
@dataclass
class Api:
    url: str
    token: str
    ray: Client      # the reference: the same service through the Ray client
    base: str        # the trainer's base model (a tiny random Llama)
    link: ProcessLink
    state_dir: Path  # the service's state folder

    def table(self) -> tuple:
        """Everything a request could change: every job's row and the newest transition's number."""
        return [r.as_dict() for r in self.ray.jobs()], self.ray.transitions_after(None)[0]

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture(scope="module")
def api(ray_session, tiny_model_dirs, tmp_path_factory) -> Iterator[Api]:
    base = str(tiny_model_dirs["llama"])
    name = f"aspen-http-test-{uuid.uuid4().hex[:6]}"
    state_dir = tmp_path_factory.mktemp("state")
    config = ServiceConfig(state_dir=state_dir, tick_seconds=0.1, trainers=[
        TrainerConfig(base_model=base, step_tokens=512, num_cpus=0.5, threads=1)])
    service = Client.local(config, name=name)
    token = ensure_token(tmp_path_factory.mktemp("token") / "http-token")
    # as `aspen http` serves: the Ray connection in a child process, attached to this session's cluster
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    app = create_app(link, token, max_body_bytes=BODY_LIMIT, events_poll_s=0.1)
    try:
        with running_server(app) as url:
            yield Api(url, token, service, base, link, state_dir)
    finally:
        link.close()
        service.shutdown()


def test_a_job_over_http_submit_list_status_losses_events_and_cancel(api, tmp_path, monkeypatch):
    http = HttpClient(api.url, api.token)
    stream = http.events(timeout=60)
    snapshot = next(stream)
    assert snapshot.kind == "snapshot" and int(snapshot.id) == api.ray.transitions_after(None)[0]
    data = write_task_data(tmp_path / "data", "sql")
    job = http.submit(job_dict("sql-http", data, 3), base_model=api.base, output_dir=tmp_path / "sql")
    assert job.id in [r.id for r in http.jobs()]
    assert http.status("sql-http").id == job.id                  # by its name, as the Ray client finds it
    done = job.wait(timeout=120)
    assert done.state == "completed", done
    assert http.status(job.id) == api.ray.status(job.id)          # the same record as the Ray client's
    assert http.jobs(["completed"]) == api.ray.jobs(("completed",))
    losses = job.losses()
    assert losses == api.ray.losses(job.id) and [r["step"] for r in losses] == [1, 2, 3]
    assert all(r["loss"] > 0 for r in losses)
    assert http.transitions(job.id) == [tuple(t) for t in api.ray.transitions(job.id)]
    assert (tmp_path / "sql" / "adapter_model.safetensors").is_file()
    exported = http.export(job.id, tmp_path / "exported")         # as `aspen export` writes it from the folder
    local = export_adapter(tmp_path / "sql", tmp_path / "exported-here")
    assert sorted(p.name for p in exported.iterdir()) == sorted(p.name for p in local.iterdir())
    for file in local.iterdir():
        assert (exported / file.name).read_bytes() == file.read_bytes(), file.name

    seen = []   # the stream, opened before the submission, has every transition of the job, in order
    for event in stream:
        if event.kind == "transition" and event.data["job"] == job.id:
            seen.append(event)
            if event.data["state"] == "completed":
                break
    stream.close()
    assert [e.data["state"] for e in seen] == [state for _, state, _ in api.ray.transitions(job.id)]
    assert seen[0].data["previous"] is None and seen[-1].data["previous"] == "running"
    assert seen[0].data["name"] == "sql-http" and [int(e.id) for e in seen] == sorted(int(e.id) for e in seen)
    # resuming after the first event (Last-Event-ID) replays the rest, and no snapshot
    resumed = http.events(job=job.id, after=seen[0].id, timeout=30)
    replay = [next(resumed) for _ in seen[1:]]
    resumed.close()
    assert [(e.kind, e.id, e.data["state"]) for e in replay] == [("transition", e.id, e.data["state"])
                                                                  for e in seen[1:]]

    before = api.table()
    with pytest.raises(Conflict, match="already ended"):          # 409: cancelling a finished job
        http.cancel(job.id)
    assert api.table() == before

    monkeypatch.chdir(tmp_path)   # a relative data path is taken from the client's folder, as the Ray client does
    long = http.submit(job_dict("long-http", Path("data/sql.jsonl"), 5000), base_model=api.base,
                       output_dir=tmp_path / "long")
    assert api.ray.submission(long.id).job.data == data
    progress = http.events(job=long.id, progress=True, timeout=60)
    step = next(e for e in progress if e.kind == "progress")
    progress.close()
    assert step.data["job"] == long.id and step.data["step"] >= 1 and step.data["loss"] > 0
    with pytest.raises(Conflict, match="wait until it completes"):   # still training: no final adapter yet
        http.export(long.id, tmp_path / "too-soon")
    assert not (tmp_path / "too-soon").exists()
    assert http.cancel(long.id).state in ("running", "cancelled")   # a running job stops at its next step
    assert long.wait(timeout=60).state == "cancelled"
    assert api.ray.status(long.id).state == "cancelled"


def test_the_cli_over_the_api_exits_3_on_a_wrong_token(api, tmp_path):
    """A refused token is its own exit code (3, as the README's exit codes say), not a bad command line (2)."""
    status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--url", api.url],
                            env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token[::-1]},
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 3 and "wrong token" in status.stderr, status.stderr
    right = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--url", api.url],
                           env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token},
                           capture_output=True, text=True, timeout=120)
    assert right.returncode == 0, right.stderr


def test_refused_requests_change_nothing_in_the_service(api, tmp_path):
    http = HttpClient(api.url, api.token)
    data = write_task_data(tmp_path / "data", "held")
    held = http.submit(job_dict("held-http", data, 5), base_model=NOBODYS_MODEL)
    wait_for(lambda: http.status(held.id).reason.startswith("no trainer"), what="the job's waiting reason")
    fresh = {**job_dict("fresh-http", data, 3), "base_model": api.base}
    raw = httpx.Client(base_url=api.url, timeout=30)
    auth = api.auth()
    json_type = {**auth, "Content-Type": "application/json"}
    cases = [   # (what, request, status, a phrase of the answer)
        ("no token", lambda: raw.post("/v1/jobs", json=fresh), 401, "Authorization: Bearer"),
        ("a wrong token", lambda: raw.post("/v1/jobs", json=fresh, headers={"Authorization": "Bearer " + "x" * 43}),
         401, "wrong token"),
        ("a token one character short", lambda: raw.post("/v1/jobs", json=fresh, headers={
            "Authorization": f"Bearer {api.token[:-1]}"}), 401, "wrong token"),
        ("basic authentication", lambda: raw.post("/v1/jobs", json=fresh, headers={
            "Authorization": "Basic dXNlcjpwYXNz"}), 401, "Authorization: Bearer"),
        ("no token, cancelling", lambda: raw.post(f"/v1/jobs/{held.id}/cancel"), 401, "Authorization"),
        ("no token, listing", lambda: raw.get("/v1/jobs"), 401, "Authorization"),
        ("no token, events", lambda: raw.get("/v1/events"), 401, "Authorization"),
        ("malformed JSON", lambda: raw.post("/v1/jobs", content=b'{"name": "x", "data": ', headers=json_type), 422,
         "malformed JSON"),
        ("malformed YAML", lambda: raw.post("/v1/jobs", content=b"name: [x\n", headers={
            **auth, "Content-Type": "application/yaml"}), 422, "malformed YAML"),
        ("JSON nested beyond reason", lambda: raw.post("/v1/jobs", content=b"[" * 50_000, headers=json_type), 422,
         "nested too deeply"),
        ("YAML aliases", lambda: raw.post("/v1/jobs", content=b"a: &a [x, x]\nb: [*a, *a]\n", headers={
            **auth, "Content-Type": "application/yaml"}), 422, "aliases"),
        ("not a mapping", lambda: raw.post("/v1/jobs", json=[fresh], headers=auth), 422, "send a mapping"),
        ("an empty body", lambda: raw.post("/v1/jobs", content=b"", headers=json_type), 422, "empty"),
        ("a form, not JSON or YAML", lambda: raw.post("/v1/jobs", data={"name": "x"}, headers=auth), 415,
         "application/json"),
        ("an oversized body", lambda: raw.post("/v1/jobs", content=b" " * (BODY_LIMIT + 1), headers=json_type), 413,
         f"at most {BODY_LIMIT}"),
        ("an oversized chunked body", lambda: raw.post("/v1/jobs", content=iter([b" " * BODY_LIMIT, b" {}"]),
                                                       headers=json_type), 413, f"at most {BODY_LIMIT}"),
        ("an invalid spec", lambda: raw.post("/v1/jobs", json={**fresh, "lora": {"r": 0}}, headers=auth), 422,
         "field lora.r: must be between 1 and 1024"),
        ("an unknown field", lambda: raw.post("/v1/jobs", json={**fresh, "learning_rate": 0.1}, headers=auth), 422,
         "field learning_rate: unknown field"),
        ("a missing data file", lambda: raw.post("/v1/jobs", json={**fresh, "data": str(tmp_path / "nope.jsonl")},
                                                 headers=auth), 422, "field data: file"),
        ("a relative data path", lambda: raw.post("/v1/jobs", json={**fresh, "data": "data/held.jsonl"},
                                                  headers=auth), 422, "relative path"),
        ("two jobs of one name in a batch", lambda: raw.post("/v1/jobs", json={"base_model": api.base, "jobs": [
            job_dict("twin", data, 3), job_dict("twin", data, 3)]}, headers=auth), 422, "two jobs are named 'twin'"),
        ("a duplicate of an unfinished job's name", lambda: raw.post("/v1/jobs", json={
            **job_dict("held-http", data, 5), "base_model": NOBODYS_MODEL}, headers=auth), 409, "already queued"),
        ("another job's output folder", lambda: raw.post("/v1/jobs", json={
            **fresh, "output_dir": api.ray.status(held.id).output_dir}, headers=auth), 409, "already writes to"),
        ("an unknown job", lambda: raw.get("/v1/jobs/no-such-job", headers=auth), 404, "no job with id or name"),
        ("cancelling an unknown job", lambda: raw.post("/v1/jobs/no-such-job/cancel", headers=auth), 404,
         "no job with id or name"),
        ("losses of an unknown job", lambda: raw.get("/v1/jobs/no-such-job/losses", headers=auth), 404, "no job"),
        ("events of an unknown job", lambda: raw.get("/v1/events?job=no-such-job", headers=auth), 404, "no job"),
        ("resuming a queued job", lambda: raw.post(f"/v1/jobs/{held.id}/resume", headers=auth), 409,
         "only paused, failed or cancelled"),
        ("an unknown state filter", lambda: raw.get("/v1/jobs?state=done", headers=auth), 422, "unknown job states"),
        ("a bad Last-Event-ID", lambda: raw.get("/v1/events", headers={**auth, "Last-Event-ID": "x"}), 422,
         "Last-Event-ID"),
    ]
    before = api.table()
    for what, request, status, phrase in cases:
        response = request()
        assert response.status_code == status, (what, response.status_code, response.text)
        assert response.headers["content-type"].startswith("application/json"), (what, response.headers)
        assert phrase in response.json()["detail"], (what, response.json())
        assert api.table() == before, f"{what}: the service changed"
    # the 422 names each field as data: its location and message
    errors = raw.post("/v1/jobs", json={**fresh, "lora": {"r": 0}, "lr": -1}, headers=auth).json()["errors"]
    assert sorted(e["field"] for e in errors) == ["lora.r", "lr"], errors
    assert [e["loc"] for e in errors if e["field"] == "lora.r"] == [["lora", "r"]]
    assert raw.post("/v1/jobs", json=fresh).headers["www-authenticate"].startswith("Bearer")
    # the Ray-free client raises the server's refusals as exceptions carrying its message
    with pytest.raises(Unauthorized, match="wrong token"):
        HttpClient(api.url, "y" * 43).jobs()
    with pytest.raises(JobNotFound, match="no job with id or name 'no-such-job'"):
        http.status("no-such-job")
    with pytest.raises(SpecRefused, match=r"field lora\.r: must be between 1 and 1024") as refused:
        http.submit({**job_dict("bad-http", data, 3), "lora": {"r": 0}}, base_model=api.base)
    assert refused.value.status == 422 and refused.value.errors[0]["loc"] == ["lora", "r"]
    with pytest.raises(Conflict, match="already queued"):
        http.submit(job_dict("held-http", data, 5), base_model=NOBODYS_MODEL)
    assert api.table() == before

    # what is accepted: a jobs file as YAML, all of its jobs at once
    yaml_text = "\n".join([f"base_model: {NOBODYS_MODEL}", "jobs:"] + [
        f"  - {{name: {name}, data: {data}, max_steps: 2, format: {{type: prompt_response, prompt: 'Q: {{question}}',"
        f" response: ' {{answer}}'}}}}" for name in ("yaml-a", "yaml-b")])
    response = raw.post("/v1/jobs", content=yaml_text, headers={**auth, "Content-Type": "application/yaml"})
    assert response.status_code == 201, response.text
    entered = response.json()["jobs"]
    assert [j["name"] for j in entered] == ["yaml-a", "yaml-b"] and all(j["state"] == "queued" for j in entered)
    assert {j["id"] for j in entered} <= {r.id for r in api.ray.jobs()}
    for job_id in [held.id, *(j["id"] for j in entered)]:
        assert http.cancel(job_id).state == "cancelled"
    assert api.ray.status(held.id).state == "cancelled"


def test_hostile_bodies_are_refused_within_a_second_and_a_slow_parse_stalls_nothing(api, tmp_path, monkeypatch):
    """The bodies that hung the server when it parsed YAML on its event loop (a megabyte of nested brackets:
    no answer in 120 s, /v1/health stalled for 60 s; a megabyte with a late alias: 6.6 s, health stalled as
    long), sent to a server with the default body limit (1 MiB, so that they reach the parser): each refused in
    under a second, naming the limit, nothing entered. Then a parse that takes its time (held until the test
    lets it go, busy, as a pure-Python parser holds the GIL) while /v1/health and /v1/jobs answer; the jobs
    file it parses is entered once it is let go."""
    app = create_app(api.link, api.token, events_poll_s=0.1)
    yaml_type = {**api.auth(), "Content-Type": "application/yaml"}
    json_type = {**api.auth(), "Content-Type": "application/json"}
    late_alias = ("padding: '" + "p" * 1_000_000 + "'\nfirst: &x 1\nsecond: *x\n").encode()
    many_values = ("\n".join(f"k{i}: v{i}" for i in range(70_000)) + "\nfirst: &x 1\nsecond: *x\n").encode()
    cases = [   # (what, body, headers, status, a phrase of the answer)
        ("a megabyte of nested brackets (YAML)", b"[" * 1_000_000, yaml_type, 422, "nested too deeply"),
        ("a megabyte of nested brackets (JSON)", b"[" * 1_000_000, json_type, 422, "nested too deeply"),
        ("a megabyte, then an alias", late_alias, yaml_type, 422, "anchors and aliases"),
        ("a megabyte of values, then an alias", many_values, yaml_type, 413, "more than 30000 values"),
        ("over the body limit", b"[" * (2**20 + 1), yaml_type, 413, f"at most {2**20}"),
    ]
    data = write_task_data(tmp_path / "data", "slow")
    jobs_file = "\n".join([f"base_model: {NOBODYS_MODEL}", "jobs:"] + [
        f"  - {{name: {name}, data: {data}, max_steps: 2, format: {{type: alpaca}}}}" for name in ("slow-a", "slow-b")])
    with running_server(app) as url:
        raw = httpx.Client(base_url=url, timeout=120)
        before = api.table()
        for what, body, headers, status, phrase in cases:
            started = time.monotonic()
            response = raw.post("/v1/jobs", content=body, headers=headers)
            took = time.monotonic() - started
            assert response.status_code == status, (what, response.status_code, response.text[:300])
            assert phrase in response.json()["detail"], (what, response.json()["detail"][:300])
            assert took < 1.0, f"{what}: answered in {took:.2f} s"
        assert api.table() == before

        parsing, release = threading.Event(), threading.Event()
        parse_body = http_jobs.parse_body

        def slow_parse(*args, **kwargs):
            parsing.set()
            deadline = time.monotonic() + 120
            while not release.is_set() and time.monotonic() < deadline:
                pass   # busy in Python, as a slow parser is: the GIL is given up only at switch intervals
            return parse_body(*args, **kwargs)

        monkeypatch.setattr(http_jobs, "parse_body", slow_parse)
        answers = {}
        submit = threading.Thread(target=lambda: answers.update(
            submitted=raw.post("/v1/jobs", content=jobs_file, headers=yaml_type)))
        submit.start()
        try:
            assert parsing.wait(timeout=60), "the submission was never parsed"
            for _ in range(3):
                started = time.monotonic()
                health = raw.get("/v1/health")
                took = time.monotonic() - started
                assert health.status_code == 200 and health.json()["status"] == "ok", health.text
                assert took < 1.0, f"/v1/health answered in {took:.2f} s during a parse"
            assert raw.get("/v1/jobs", headers=api.auth()).status_code == 200
            assert submit.is_alive() and "submitted" not in answers   # all of it while the parse went on
        finally:
            release.set()
            submit.join(timeout=120)
    response = answers["submitted"]
    assert response.status_code == 201, response.text
    entered = response.json()["jobs"]
    assert [job["name"] for job in entered] == ["slow-a", "slow-b"]
    for job in entered:
        assert api.ray.cancel(job["id"]).state == "cancelled"


def test_a_sweep_over_http_runs_in_the_service_and_refusals_name_the_field(api, tmp_path, monkeypatch):
    """POST /v1/sweeps as the Ray client's Client.sweep (the reference: the same sweep's status through Ray);
    invalid sweeps refused with the field (422), an unknown sweep a 404, a cancelled sweep's trials cancelled."""
    http = HttpClient(api.url, api.token)
    monkeypatch.chdir(tmp_path)
    write_task_data(tmp_path / "data", "qa", rows=24)
    job = {**job_dict("qa", "data/qa.jsonl", 4, eval_split=4, eval_every=2), "checkpoint_every": 100}
    sweep = {"name": "http-lr", "base_model": api.base, "output_dir": str(tmp_path / "out"), "step_tokens": 512,
             "job": job, "search": "grid", "max_concurrent": 2, "space": {"lr": {"choice": [1e-3, 2e-3]}}}
    before = api.table()
    refused = httpx.post(f"{api.url}/v1/sweeps", headers=api.auth(), json=sweep)   # raw: a relative path
    assert refused.status_code == 422 and "job.data: data/qa.jsonl is a relative path" in refused.json()["detail"]
    with pytest.raises(SpecRefused, match="space.lora.rank: job.lora has no field 'rank'; did you mean lora.r"):
        http.sweep({**sweep, "space": {"lora.rank": {"choice": [4, 8]}}})
    with pytest.raises(JobNotFound, match="no sweep named 'nope'"):
        http.sweep_status("nope")
    assert api.table() == before                                  # nothing of them reached the service

    started = http.sweep(sweep)                                   # data resolved against this folder
    assert started["name"] == "http-lr" and started["state"] == "running"
    status = wait_for(lambda: (found := http.sweep_status("http-lr"))["state"] == "done" and found, 180,
                      "the sweep over HTTP to end")
    assert status == api.ray.sweep_status("http-lr")
    assert [t["state"] for t in status["trials"]] == ["completed", "completed"] and status["best"]
    assert {t["name"] for t in status["trials"]} <= {r.name for r in api.ray.jobs(("completed",))}

    cancelled = http.sweep({**sweep, "name": "http-cancel", "output_dir": str(tmp_path / "cancel"),
                            "job": {**job, "max_steps": 400, "eval_every": 200}})
    assert cancelled["state"] == "running"
    wait_for(lambda: http.sweep_status("http-cancel")["trials"], 60, "the cancelled sweep's first trials")
    http.cancel_sweep("http-cancel")
    status = wait_for(lambda: (found := http.sweep_status("http-cancel"))["state"] != "running" and found, 120,
                      "the cancelled sweep to end")
    assert status["state"] == "cancelled" and all(t["state"] == "cancelled" for t in status["trials"]), status
    assert "http-cancel" in {s["name"] for s in http.sweeps()}


def test_the_openapi_schema_lists_every_endpoint_and_the_bearer_scheme(api):
    schema = httpx.get(f"{api.url}/openapi.json").json()
    assert {"/v1/jobs", "/v1/jobs/{job}", "/v1/jobs/{job}/cancel", "/v1/jobs/{job}/losses", "/v1/events",
            "/v1/jobs/{job}/adapter",
            "/v1/health", "/v1/service", "/v1/sweeps", "/v1/sweeps/{name}", "/v1/sweeps/{name}/cancel"
            } <= set(schema["paths"])
    assert set(schema["paths"]["/v1/jobs"]) == {"get", "post"}
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml"}
    assert {"JobSpec", "RunSpec", "LoraConfig", "JobRecord"} <= set(schema["components"]["schemas"])
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "security" not in schema["paths"]["/v1/health"]["get"]
    assert schema["paths"]["/v1/jobs/{job}"]["get"]["security"] == [{"HTTPBearer": []}]
    assert httpx.get(f"{api.url}/v1/health").json() == {"status": "ok", "service": "up", "detail": None}


def test_a_service_that_does_not_answer_is_a_503_and_the_server_stays_up(ray_session, tmp_path):
    token = ensure_token(tmp_path / "token")
    app = create_app(ServiceLink(name=f"aspen-nobody-{uuid.uuid4().hex[:6]}"), token)
    with running_server(app) as url:
        for _ in range(2):   # the server answers again (and tries to connect again) after a failure
            response = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 503 and "no aspen service" in response.json()["detail"], response.text
            assert response.headers["retry-after"] == "5"
        health = httpx.get(f"{url}/v1/health")
        assert health.status_code == 503 and health.json()["service"] == "unavailable"
        assert httpx.get(f"{url}/v1/jobs").status_code == 401   # the token is checked first


def test_the_http_client_and_the_cli_with_url_need_no_ray(api, tmp_path):
    """`aspen submit/status/losses/cancel --url` in a fresh process: it works, and Ray is never imported."""
    data = write_task_data(tmp_path / "data", "cli")
    (tmp_path / "jobs.yaml").write_text(json.dumps({"base_model": api.base, "output_dir": "out", "jobs": [
        {**job_dict("cli-http", Path("data/cli.jsonl"), 2)}]}))   # relative: taken from the file's folder
    script = ("import sys, orchestrator.http.api_client; assert not {'ray', 'torch'} & set(sys.modules), 'imported'; "
              "from orchestrator.cli import main; code = main(sys.argv[1:]); "
              "assert 'ray' not in sys.modules, 'ray was imported'; sys.exit(code)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASPEN_URL": api.url, "ASPEN_TOKEN": api.token}

    def aspen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    submitted = aspen("submit", "jobs.yaml", "--json")
    assert submitted.returncode == 0, submitted.stderr
    (job,) = json.loads(submitted.stdout)
    assert job["name"] == "cli-http"
    assert api.ray.submission(job["id"]).job.data == data            # the file's relative path, resolved
    assert api.ray.status(job["id"]).output_dir == str(tmp_path / "out" / "cli-http")
    assert api.ray.wait(job["id"], timeout=120).state == "completed"
    losses = aspen("losses", job["id"], "--json")
    assert losses.returncode == 0, losses.stderr
    assert json.loads(losses.stdout) == api.ray.losses(job["id"])
    listed = aspen("status", "--json", "--url", api.url)
    assert job["id"] in [r["id"] for r in json.loads(listed.stdout)]
    exported = aspen("export", "cli-http", "--out", "cli-lora", "--json")   # through the API: its owner's adapter
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["folder"] == "cli-lora"
    assert (tmp_path / "cli-lora" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "out" / "cli-http" / "adapter_model.safetensors").read_bytes()
    refused = aspen("cancel", job["id"])
    assert refused.returncode == 2 and "already ended" in refused.stderr and "(HTTP 409)" in refused.stderr


def test_the_token_file_is_private_generated_once_and_read_by_clients(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main

    path = tmp_path / "aspen" / "http-token"
    token = ensure_token(path)
    assert len(token) >= 43 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token == read_token(path)
    assert main(["http-token", "--token-file", str(path)]) == 0
    assert capsys.readouterr().out.strip() == token
    monkeypatch.delenv("ASPEN_TOKEN", raising=False)
    monkeypatch.setenv("ASPEN_TOKEN_FILE", str(path))
    assert client_token() == token
    monkeypatch.setenv("ASPEN_TOKEN", "from-the-environment")
    assert client_token() == "from-the-environment"
    rotated = ensure_token(path, rotate=True)
    assert rotated != token and read_token(path) == rotated
    path.chmod(0o644)
    with pytest.raises(TokenFileError, match="readable by other users"):
        read_token(path)
    with pytest.raises(TokenFileError, match="no HTTP API token"):
        read_token(tmp_path / "missing")


def test_the_ray_connection_lives_in_a_child_process_replaced_when_it_dies(api):
    """The server never joins Ray (a driver dies with its cluster); its Ray connection's process does, and a
    new one serves the next request."""
    http = HttpClient(api.url, api.token)
    assert http.jobs() == api.ray.jobs()
    first = api.link.pid
    assert first is not None and first != os.getpid()
    os.kill(first, 9)
    wait_for(lambda: not api.link.bridge.alive, timeout=10, what="the server to notice")
    assert http.jobs() == api.ray.jobs()
    assert api.link.pid not in (None, first)


def test_aspen_http_serves_on_loopback_with_a_generated_token_and_stops_on_sigterm(ray_session, tmp_path):
    """`aspen http` as a user starts it: a token file made for it (0600), loopback, 401 without the token, a 503
    naming the missing service (none runs under the default name here), and a prompt stop."""
    from orchestrator.http.api import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7")
    port = free_port()
    token_path = tmp_path / "token"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    server = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "http", "--port", str(port), "--address",
                               ray_session.get_runtime_context().gcs_address, "--token-file", str(token_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/openapi.json", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, timeout=60, what="`aspen http` to answer", every=0.2)
        assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
        token = read_token(token_path)
        assert httpx.get(f"{url}/v1/jobs").status_code == 401
        response = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=60)
        assert response.status_code == 503 and "no aspen service ('aspen-scheduler'" in response.json()["detail"]
        # the CLI over the API: the service missing behind the server is a runtime failure (exit 1)
        status = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--url", url],
                                env={**env, "ASPEN_TOKEN": token}, capture_output=True, text=True, timeout=120)
        assert status.returncode == 1 and "no aspen service" in status.stderr, status.stderr
        server.terminate()
        output, _ = server.communicate(timeout=30)
        assert server.returncode in (0, -signal.SIGTERM), output   # uvicorn re-raises the signal once stopped
        assert "Finished server process" in output
        assert f"aspen HTTP API on http://127.0.0.1:{port}" in output and str(token_path) in output
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()


@pytest.fixture()
def users(api, tmp_path) -> Iterator[UserBook]:
    """The service's users file (its state folder's: the scheduler checks each job's user and data there),
    removed after the test."""
    book = UserBook.in_state_dir(api.state_dir)
    try:
        yield book
    finally:
        book.path.unlink(missing_ok=True)


def test_each_user_sees_and_acts_on_their_own_jobs_only(api, users, tmp_path):
    """Users of a users file (actors/service/accounts/users.py): another user's job answers exactly as an unknown one on
    every endpoint and is in none of the lists, snapshots or streams; its name is taken without saying whose;
    an admin sees it; a rotated or removed token is refused from the next request on; every action is in the
    audit log, which only admins read. The Ray client's record (the reference) names the job's owner, and the
    job writes under the outputs' folder of its user."""
    audit = AuditLog.in_state_dir(tmp_path / "audit")
    data = write_task_data(tmp_path / "data", "own")
    root, _ = users.add("root", admin=True)
    alice, _ = users.add("alice", data_roots=[str(tmp_path / "data")])
    bob, _ = users.add("bob", data_roots=[str(tmp_path / "data")])
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users, audit=audit)
    with running_server(app) as url:
        raw = httpx.Client(base_url=url, timeout=60)

        def get(path: str, token: str) -> httpx.Response:
            return raw.get(path, headers={"Authorization": f"Bearer {token}"})

        assert get("/v1/jobs", api.token).status_code == 401        # with users, the single token is no one's
        as_alice, as_bob, as_root = HttpClient(url, alice), HttpClient(url, bob), HttpClient(url, root)
        bobs_stream = as_bob.events(timeout=60)
        assert next(bobs_stream).kind == "snapshot"
        job = as_alice.submit(job_dict("alices-job", data, 2), base_model=NOBODYS_MODEL)
        assert api.ray.status(job.id).user == "alice"
        assert api.ray.status(job.id).output_dir == str((api.state_dir / "outputs" / "alice" / job.id).resolve())
        for key in (job.id, "alices-job"):
            for path in (f"/v1/jobs/{key}", f"/v1/jobs/{key}/losses", f"/v1/jobs/{key}/transitions",
                         f"/v1/jobs/{key}/adapter"):
                answer = get(path, bob)
                assert answer.status_code == 404 and answer.json()["detail"] == f"no job with id or name '{key}'", path
            for verb in ("cancel", "pause", "resume"):
                answer = raw.post(f"/v1/jobs/{key}/{verb}", headers={"Authorization": f"Bearer {bob}"})
                assert answer.status_code == 404 and answer.json()["detail"] == f"no job with id or name '{key}'"
        assert job.id not in [r.id for r in as_bob.jobs()]
        assert job.id in [r.id for r in as_alice.jobs()] and as_root.status(job.id).user == "alice"
        later = as_bob.events(timeout=60)
        assert job.id not in [r["id"] for r in next(later).data["jobs"]]
        later.close()
        with pytest.raises(Conflict) as taken:
            as_bob.submit(job_dict("alices-job", data, 2), base_model=NOBODYS_MODEL)
        assert "held by another user's unfinished job" in str(taken.value) and job.id not in str(taken.value)
        assert as_alice.cancel(job.id).state == "cancelled"
        mine = as_bob.submit(job_dict("bobs-job", data, 2), base_model=NOBODYS_MODEL)
        seen = []
        for event in bobs_stream:   # bob's stream, open since before alice's job: bob's job only
            if event.kind == "transition":
                seen.append(event.data["job"])
                if event.data["job"] == mine.id:
                    break
        bobs_stream.close()
        assert seen == [mine.id]
        assert as_bob.cancel(mine.id).state == "cancelled"

        rotated = users.rotate("alice")            # refused from the next request on, the new one admitted
        assert get("/v1/jobs", alice).status_code == 401 and get("/v1/jobs", rotated).status_code == 200
        users.remove("bob")
        assert get("/v1/jobs", bob).status_code == 401
        assert get("/v1/audit", rotated).status_code == 403
        rows = get("/v1/audit", root).json()
        assert [(r["user"], r["action"], r["target"]) for r in rows] == [
            ("alice", "job.submit", job.id), ("alice", "job.cancel", job.id), ("bob", "job.submit", mine.id),
            ("bob", "job.cancel", mine.id)]
        assert rows == audit.rows() and all(r["time"] > 0 for r in rows)
        accounts = {row["user"]: row for row in as_root.accounts()}   # their jobs never trained: no usage yet
        assert accounts["alice"] == {"user": "alice", "jobs": 1, "tokens": 0, "step_seconds": 0.0, "gpu_seconds": 0.0}
        assert [row["user"] for row in HttpClient(url, rotated).accounts()] == ["alice"]   # a user: their own


def test_a_users_job_reads_only_under_its_data_roots(api, users, tmp_path):
    """A user's job whose data lies outside the service's and the user's data roots is refused at submit,
    naming the roots, and nothing is entered: a plain path, `../` out of a root, a symlink out of a root (the
    data itself, or a file inside a data folder), a URI prefix not listed, the service's state folder and
    another user's outputs; a file outside that does not exist is refused as outside (its existence is not
    revealed); a sweep whose job reads outside is refused when it is posted; the same data inside the root is
    taken. Refusals change nothing in the table."""
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    good = write_task_data(inside, "good")
    secret = write_task_data(outside, "secret")
    (inside / "link.jsonl").symlink_to(secret)
    folder = inside / "folder"
    folder.mkdir()
    (folder / "train.jsonl").symlink_to(secret)                 # a data folder with a file that links out
    state_data = write_task_data(api.state_dir / "stolen", "state")
    others = write_task_data(api.state_dir / "outputs" / "root" / "x", "others")
    alice, _ = users.add("alice", data_roots=[str(inside), "s3://team-a/data"])
    users.add("root", admin=True)
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    cases = [(secret, "is outside the data roots"), (inside / ".." / "outside" / "secret.jsonl", "is outside"),
             (inside / "link.jsonl", "is outside"), (outside / "missing.jsonl", "is outside"), (folder, "links out"),
             ("s3://team-a/database/x.jsonl", "is outside"), ("s3://team-a/data/../other/x.jsonl", "'..'"),
             (state_data, "the service's state folder"), (others, "the service's outputs other than yours")]
    with running_server(app) as url:
        as_alice = HttpClient(url, alice)
        before = api.table()
        for data, phrase in cases:
            with pytest.raises(SpecRefused) as refused:
                as_alice.submit(job_dict("reader", data, 2), base_model=NOBODYS_MODEL)
            assert phrase in str(refused.value), (data, str(refused.value))
            if phrase.startswith("is outside") or phrase == "links out":
                assert str(inside) in str(refused.value) and "s3://team-a/data" in str(refused.value)
        assert api.table() == before
        sweep = {"name": "outside", "base_model": NOBODYS_MODEL, "output_dir": str(tmp_path / "sweep"),
                 "job": {**job_dict("reader", secret, 4), "eval_split": 4, "eval_every": 2}, "search": "grid",
                 "space": {"lr": {"choice": [1e-3, 1e-2]}}}
        answer = httpx.post(f"{url}/v1/sweeps", json=sweep, headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        assert answer.status_code == 422 and "is outside the data roots" in answer.json()["detail"], answer.text
        assert as_alice.sweeps() == [] and api.table() == before
        job = as_alice.submit(job_dict("reader", good, 2), base_model=NOBODYS_MODEL)
        assert api.ray.status(job.id).user == "alice"
        as_alice.cancel(job.id)


def test_a_second_users_job_starts_at_the_first_free_slot_ahead_of_anothers_twenty(ray_session, tiny_model_dirs,
                                                                                   tmp_path):
    """Fair share on a real service, through HTTP: on a trainer that runs one job at a time, alice submits 20
    jobs and, once hers train, bob submits one; the very next job the scheduler starts after his submission
    is his (his share of the trained tokens is none, hers all of them), not one of hers queued before his.
    The order is read from the job table's own transition log (through the Ray client)."""
    from tests.helpers.service import NO_LISTENERS, service_config

    state_dir = tmp_path / "state"
    book = UserBook.in_state_dir(state_dir)
    alice, _ = book.add("alice", data_roots=[str(tmp_path / "data")])
    bob, _ = book.add("bob", data_roots=[str(tmp_path / "data")])
    base = str(tiny_model_dirs["llama"])
    service = Client.local(service_config(state_dir, tiny_model_dirs["llama"], listeners=NO_LISTENERS, max_jobs=1),
                           name=f"aspen-fair-{uuid.uuid4().hex[:6]}")
    try:
        app = create_app(ServiceLink(client=service), "unused-single-token", events_poll_s=0.1, users=book)
        with running_server(app) as url:
            as_alice, as_bob = HttpClient(url, alice), HttpClient(url, bob)
            data = write_task_data(tmp_path / "data", "fair")
            hers = as_alice.submit_many([job_dict(f"a{i:02d}", data, 3) for i in range(20)], base_model=base)
            wait_for(lambda: any(r.step >= 1 for r in as_alice.jobs()), timeout=120, what="alice's jobs to train")
            [his] = as_bob.submit_many([job_dict("b00", data, 2)], base_model=base)
            assert his.wait(timeout=180).state == "completed"
            _, rows = service.transitions_after(0, 10000)
            submitted = next(row["seq"] for row in rows if row["job"] == his.id)
            started = [row["job"] for row in rows if row["state"] == "running" and row["seq"] < submitted]
            first_after = next(row["job"] for row in rows if row["state"] == "running" and row["seq"] > submitted
                               and row["job"] not in started)
            assert first_after == his.id, [(r["job"], r["state"]) for r in rows if r["seq"] > submitted][:6]
            assert len({h.id for h in hers} - set(started)) >= 15, started   # most of hers still queued then
            for handle in hers:
                if service.status(handle.id).state in ("queued", "running"):
                    service.cancel(handle.id)
    finally:
        service.shutdown()


def test_a_server_over_a_running_service_reads_the_services_own_users(api, users, tmp_path):
    """`aspen http --address ADDR` without --state-dir, as the README starts it, beside a service whose users were
    added with `aspen user add --state-dir <its folder>`: the server asks the service where its state lives
    (`ServiceStateFolder`, what `serve` builds), so alice's token opens the API and every action is audited there;
    the single token, no longer in force, is refused with a 401 that says a users file is in force and where."""
    from orchestrator.http.callers import ServiceStateFolder
    from orchestrator.service_calls import call_service

    folder = ServiceStateFolder(lambda: call_service(api.link, lambda client: client.info()), fallback=tmp_path)
    app = create_app(api.link, api.token, users=folder.users(), audit=folder.audit())
    alice, _ = users.add("alice")
    with running_server(app) as url:
        mine = httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        assert mine.status_code == 200, mine.text
        single = httpx.get(f"{url}/v1/jobs", headers=api.auth(), timeout=60)
        assert single.status_code == 401
        assert "a users file is in force" in single.json()["detail"] and str(users.path) in single.json()["detail"]
    assert folder.path() == Path(api.state_dir).resolve()
