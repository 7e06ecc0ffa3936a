"""Data rows that do not fit their job's format, submitted through the HTTP API (as the web console submits) on a
real server over a real service: refused up front (422), before anything is entered, with the job, the data file's
row and field and what to write: the facts `aspen submit` over Ray gives for the same jobs file (the HTTP API took
them, and the job failed on its trainer seconds later); `aspen submit --url` leaves the rows to the API. A user's
data outside where they may read is refused as such, its rows never read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import ray

from orchestrator.http.api import create_app
from orchestrator.jobs_file import SpecError, check_data_rows, load_run_spec
from tests.helpers.http_server import running_server, write_jobs_file
from tests.helpers.service import job_dict, write_task_data

REPO = Path(__file__).resolve().parents[2]
YAML = {"Content-Type": "application/yaml"}


def test_rows_that_do_not_fit_are_refused_with_the_facts_aspen_submit_gives(api, tmp_path):
    good = write_task_data(tmp_path / "data", "good")
    rows = good.read_text().splitlines()
    rows[16] = '{"question": "a question", "answer": '          # line 17: not JSON
    broken = tmp_path / "data" / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")
    typo = job_dict("typo", good, 2)
    typo["format"] = {**typo["format"], "prompt": "Q: {questio}\nA:"}   # a field the rows lack
    jobs = [job_dict("fine", good, 2), typo, job_dict("broken", broken, 2)]
    jobs_file = tmp_path / "jobs.yaml"
    text = write_jobs_file(jobs_file, api.base, jobs)
    before = api.table()

    answer = httpx.post(f"{api.url}/v1/jobs", content=text, headers={**api.auth(), **YAML}, timeout=120)
    assert answer.status_code == 422, answer.text
    assert api.table() == before                                     # all or none: not even the fine job
    body = answer.json()
    errors = {error["job"]: error for error in body["errors"]}
    assert set(errors) == {"typo", "broken"}
    data_lines = [number for number, line in enumerate(text.splitlines(), 1) if line.startswith("    data:")]
    assert errors["typo"]["loc"] == ["jobs", 1, "data"] and errors["typo"]["line"] == data_lines[1]
    assert errors["typo"]["row"] == 1 and errors["typo"]["row_field"] == "questio"
    assert "field 'questio' is missing" in errors["typo"]["msg"] and "the row has: answer, question" in errors["typo"][
        "msg"]
    assert errors["broken"]["loc"] == ["jobs", 2, "data"] and errors["broken"]["line"] == data_lines[2]
    assert errors["broken"]["row"] == 17 and errors["broken"]["msg"].startswith(f"{broken}:17: invalid JSON")
    assert body["detail"].startswith("nothing was submitted:\n")
    assert f"job 'broken' (jobs[2]), field data: {broken}:17: invalid JSON" in body["detail"]
    assert body["detail"].endswith("(fix the rows or the format, then submit again)")

    # the same facts as `aspen submit` / `aspen run` over Ray give for the same file (their check, here)
    with pytest.raises(SpecError) as cli_check:
        check_data_rows(load_run_spec(jobs_file, for_a_service=True))
    assert [line.split(": ", 1)[0] for line in str(cli_check.value).splitlines()[:-1]] == ["job 'typo'", "job 'broken'"]
    for error in errors.values():
        assert f"job '{error['job']}': {error['msg']}\n" in str(cli_check.value), (error, str(cli_check.value))
    # `aspen submit --url` leaves the rows to the API (read once, where the data is): its refusal, exit 2
    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "submit", str(jobs_file), "--url", api.url],
                         env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token},
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and body["detail"] in cli.stderr, cli.stderr
    assert api.table() == before

    # one job's fields as JSON: located as `data`, its eval_split where that is what leaves nothing to train on
    single = httpx.post(f"{api.url}/v1/jobs", json={**typo, "base_model": api.base}, headers=api.auth(), timeout=120)
    assert single.status_code == 422 and single.json()["errors"][0]["loc"] == ["data"], single.text
    assert single.json()["detail"].startswith(f"nothing was submitted:\njob 'typo', field data: {good}:1: field "
                                              "'questio' is missing")
    tiny = write_task_data(tmp_path / "data", "tiny", rows=4)
    held_out = httpx.post(f"{api.url}/v1/jobs", json={**job_dict("held-out", tiny, 2, eval_split=4),
                                                      "base_model": api.base}, headers=api.auth(), timeout=120)
    assert held_out.status_code == 422 and held_out.json()["errors"][0]["loc"] == ["eval_split"], held_out.text
    assert "leaving none to train on" in held_out.json()["detail"]
    assert api.table() == before


def test_a_users_rows_are_read_only_where_they_may_read(api, users, tmp_path):
    """The service checks where the user may read before the API reads a row: bad rows outside their data roots
    are refused as outside (nothing of the file is told), inside them with the row."""
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    alice, _ = users.add("alice", data_roots=[str(inside)])
    app = create_app(api.link, api.token, events_poll_s=0.1, users=users)
    before = api.table()
    with running_server(app) as url:
        for folder, phrase in ((outside, "is outside the data roots"), (inside, "field 'questio' is missing")):
            job = job_dict("reader", write_task_data(folder, "secret"), 2)
            job["format"] = {**job["format"], "prompt": "Q: {questio}\nA:"}
            answer = httpx.post(f"{url}/v1/jobs", json={**job, "base_model": api.base},
                                headers={"Authorization": f"Bearer {alice}"}, timeout=120)
            assert answer.status_code == 422 and phrase in answer.json()["detail"], answer.text
            if folder == outside:
                assert "questio" not in answer.text and "secret.jsonl:" not in answer.text   # no row was read
    assert api.table() == before


def test_a_sweep_whose_data_has_a_bad_row_is_refused_before_any_trial_over_http_and_by_aspen_sweep(api, tmp_path):
    """A sweep's job reads a data file with a row that is not JSON: over HTTP (a sweep file sent as YAML) the sweep
    was taken and each trial failed on the row once it started; it is refused (422) with the job, the field
    `job.data` and its line in the file, the data file's row, nothing entered and no sweep made. `aspen sweep FILE
    --address` (the same service over Ray) refuses the same file before it submits anything, naming the file, the
    row and the same message. The same sweep with a good file is taken."""
    good = write_task_data(tmp_path / "data", "qa", rows=24)
    rows = good.read_text().splitlines()
    rows[16] = '{"question": "a question", "answer": '          # line 17: not JSON
    broken = tmp_path / "data" / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")

    def sweep_file(name: str, data: Path) -> Path:
        job = job_dict("qa", data, 4, eval_split=4, eval_every=2)
        lines = [f"name: {name}", f"base_model: {api.base}", f"output_dir: {tmp_path / name}", "step_tokens: 512",
                 "search: grid", "max_concurrent: 1", "space: {lr: {choice: [0.001, 0.002]}}", "job:"]
        lines += [f"  {key}: {json.dumps(value)}" for key, value in job.items()]
        path = tmp_path / f"{name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    path = sweep_file("rows", broken)
    text = path.read_text()
    before = api.table()
    answer = httpx.post(f"{api.url}/v1/sweeps", content=text, headers={**api.auth(), **YAML}, timeout=120)
    assert answer.status_code == 422, answer.text
    body = answer.json()
    (error,) = body["errors"]
    data_line = next(number for number, line in enumerate(text.splitlines(), 1) if line.startswith("  data:"))
    assert error["loc"] == ["job", "data"] and error["field"] == "job.data" and error["line"] == data_line, error
    assert error["job"] == "qa" and error["row"] == 17 and error["data"] == str(broken), error
    assert error["msg"].startswith(f"{broken}:17: invalid JSON"), error
    assert body["detail"].startswith(f"nothing was submitted:\njob 'qa', field job.data: {broken}:17: invalid JSON")
    assert body["detail"].endswith("(fix the rows or the format, then submit again)")
    assert api.table() == before and "rows" not in {s["name"] for s in api.ray.sweeps()}

    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", str(path), "--address",
                          ray.get_runtime_context().gcs_address], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert cli.stderr.startswith(f"aspen: invalid sweep file:\n{path}: a row of its data does not fit its job's "
                                 f"format\njob 'qa': {error['msg']}\n"), cli.stderr
    assert "(nothing was started: fix the rows or the format, then run again)" in cli.stderr
    assert api.table() == before and "rows" not in {s["name"] for s in api.ray.sweeps()}

    fine = httpx.post(f"{api.url}/v1/sweeps", content=sweep_file("fine", good).read_text(),
                      headers={**api.auth(), **YAML}, timeout=120)
    assert fine.status_code == 201 and fine.json()["name"] == "fine", fine.text
    api.ray.cancel_sweep("fine")


def test_a_sweep_whose_space_makes_its_rows_not_fit_is_refused_naming_the_space_value(api, tmp_path):
    """The sweep's own job reads its rows fine (max_seq_len 128), but its space also gives max_seq_len 8, shorter
    than every prompt: the sweep was taken and those trials failed once they started. Over HTTP it is refused (422)
    at `space.max_seq_len`, with the value, its line in the file and the message POST /v1/jobs gives the same job
    with max_seq_len 8 (the reference); the Ray client's `Client.sweep` and `aspen sweep --address` refuse it too
    (SpecError; exit 2) naming space.max_seq_len and the value; nothing entered and no sweep made."""
    data = write_task_data(tmp_path / "data", "a_question_with_a_rather_long_prompt", rows=24)
    job = job_dict("qa", data, 4, eval_split=4, eval_every=2)
    lines = ["name: short", f"base_model: {api.base}", f"output_dir: {tmp_path / 'short'}", "step_tokens: 512",
             "search: grid", "max_concurrent: 1", "space:", "  lr: {choice: [0.001, 0.002]}",
             "  max_seq_len: {choice: [128, 8]}", "job:"]
    lines += [f"  {key}: {json.dumps(value)}" for key, value in job.items()]
    path = tmp_path / "short.yaml"
    path.write_text("\n".join(lines) + "\n")
    text = path.read_text()
    before = api.table()

    alone = httpx.post(f"{api.url}/v1/jobs", json={**job, "max_seq_len": 8, "base_model": api.base},
                       headers=api.auth(), timeout=120)
    assert alone.status_code == 422, alone.text
    (reference,) = alone.json()["errors"]
    answer = httpx.post(f"{api.url}/v1/sweeps", content=text, headers={**api.auth(), **YAML}, timeout=120)
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["errors"]
    assert error["loc"] == ["space", "max_seq_len"] and error["field"] == "space.max_seq_len", error
    assert error["line"] == 9 and error["settings"] == {"max_seq_len": 8}, error
    assert error["msg"] == f"with max_seq_len=8: {reference['msg']}", (error, reference)
    assert f"job 'qa', field space.max_seq_len: with max_seq_len=8: {reference['msg']}" in answer.json()["detail"]

    with pytest.raises(SpecError) as over_ray:
        api.ray.sweep(path)
    assert f"job 'qa' with space.max_seq_len (max_seq_len=8): {reference['msg']}" in str(over_ray.value)
    cli = subprocess.run([sys.executable, "-m", "orchestrator.cli", "sweep", str(path), "--address",
                          ray.get_runtime_context().gcs_address], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert f"{path}: a row of its data does not fit its job's format\njob 'qa' with space.max_seq_len " \
           f"(max_seq_len=8): {reference['msg']}\n" in cli.stderr, cli.stderr
    assert api.table() == before and "short" not in {s["name"] for s in api.ray.sweeps()}


def test_the_ray_client_refuses_a_bad_row_at_submission_as_the_http_api_does(api, tmp_path):
    """Client.submit and Client.submit_many over Ray entered a job whose row 17 is not JSON (it failed on its
    trainer once it started); they now raise SpecError at submission, nothing entered, with the message the HTTP
    API's 422 gives the same job (HttpClient's SpecRefused, the reference). A good job is still taken."""
    from orchestrator.http.api_client import HttpClient, SpecRefused

    good = write_task_data(tmp_path / "data", "fine")
    rows = good.read_text().splitlines()
    rows[16] = '{"question": "a question", "answer": '          # line 17: not JSON
    broken = tmp_path / "data" / "broken.jsonl"
    broken.write_text("\n".join(rows) + "\n")
    before = api.table()
    with pytest.raises(SpecRefused) as over_http:
        HttpClient(api.url, api.token).submit(job_dict("broken", broken, 2), base_model=api.base)
    (reference,) = over_http.value.errors
    for submit in (lambda job: api.ray.submit(job, base_model=api.base),
                   lambda job: api.ray.submit_many([job_dict("fine", good, 2), job], base_model=api.base)):
        with pytest.raises(SpecError) as over_ray:
            submit(job_dict("broken", broken, 2))
        assert f"job 'broken': {reference['msg']}\n" in str(over_ray.value), (str(over_ray.value), reference)
        assert api.table() == before
    handle = api.ray.submit(job_dict("fine", good, 2), base_model=api.base)
    assert api.ray.status(handle.id).name == "fine"
    api.ray.cancel(handle.id)
