"""A `lora.target_modules` name the base has no linear layer of, submitted through the HTTP API (`POST /v1/jobs`, a
sweep's `POST /v1/sweeps`) on a real server over a real service, and by `aspen submit` / `aspen sweep` (the real
CLI, over HTTP and over Ray): the job was entered, queued, placed, and failed once its trainer had loaded the base;
now it is refused before anything is entered (422; exit 2 with the file's line), naming the field, the nearest name
and the base's layer names: those of the base as a trainer loads it (the reference). The same files without the typo
are taken. The check, which may build the base on `meta` in a process of its own (seconds), runs off the server's
event loop, once per base (kept per its files' identity: path, modification time, size)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import ray

from orchestrator import target_layers
from tests.helpers.http_server import write_jobs_file
from tests.helpers.service import job_dict, write_task_data

REPO = Path(__file__).resolve().parents[2]
YAML = {"Content-Type": "application/yaml"}


@pytest.fixture(scope="module")
def layer_names(api) -> list[str]:
    """The reference: the short names of the linear layers LoRA may adapt on the base as a trainer loads it."""
    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.models import load_base_model

    model = load_base_model(api.base, dtype="float32", device="cpu").model
    return sorted({name.rsplit(".", 1)[-1] for name in linear_module_names(model)})


def aspen(*args: str, api) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ASPEN_TOKEN": api.token}, timeout=300)


def typo_message(layer_names: list[str], typo: str, meant: str) -> str:
    return (f"'{typo}' matches no linear layer of the base model; did you mean '{meant}'? its linear layers are named "
            f"{', '.join(layer_names)} (or use 'all-linear')")


def test_post_jobs_and_aspen_submit_refuse_a_typod_target_module(api, layer_names, tmp_path):
    data = write_task_data(tmp_path / "data", "qa")
    typo = job_dict("typo", data, 2)
    typo["lora"] = {**typo["lora"], "target_modules": ["q_proj", "v_projj"]}
    path = tmp_path / "jobs.yaml"
    text = write_jobs_file(path, api.base, [job_dict("fine", data, 2), typo])
    lora_line = [number for number, line in enumerate(text.splitlines(), 1) if line.startswith("    lora:")][1]
    before = api.table()

    answer = httpx.post(f"{api.url}/v1/jobs", content=text, headers={**api.auth(), **YAML}, timeout=120)
    assert answer.status_code == 422 and answer.json().get("errors"), answer.text
    (error,) = answer.json()["errors"]
    assert error["loc"] == ["jobs", 1, "lora", "target_modules", 1] and error["line"] == lora_line, error
    assert error["job"] == "typo" and error["target"] == "v_projj" and error["type"] == "target_module", error
    assert error["msg"] == typo_message(layer_names, "v_projj", "v_proj"), error
    assert answer.json()["detail"].startswith("nothing was submitted:\njob 'typo' (jobs[1]), field "
                                              "lora.target_modules.1: 'v_projj' matches no linear layer")
    assert api.table() == before

    one = {**typo, "base_model": api.base}   # one job's fields, as JSON
    answer = httpx.post(f"{api.url}/v1/jobs", json=one, headers=api.auth(), timeout=120)
    assert answer.status_code == 422 and answer.json().get("errors"), answer.text
    (error,) = answer.json()["errors"]
    assert error["loc"] == ["lora", "target_modules", 1] and error["field"] == "lora.target_modules.1", error
    assert api.table() == before

    gcs = ray.get_runtime_context().gcs_address
    for where in (["--url", api.url], ["--address", gcs]):
        cli = aspen("submit", str(path), *where, api=api)
        assert cli.returncode == 2, (cli.stdout, cli.stderr)
        assert (f"aspen: invalid jobs file:\n{path}:{lora_line}: job 'typo' (jobs[1]), field lora.target_modules: "
                f"{typo_message(layer_names, 'v_projj', 'v_proj')}\n(nothing was submitted: fix the names for base "
                f"{api.base}, then submit again)") in cli.stderr, cli.stderr
        assert api.table() == before

    path.write_text(text.replace("v_projj", "v_proj").replace('"typo"', '"typo-fixed"'))
    cli = aspen("submit", str(path), "--url", api.url, api=api)
    assert cli.returncode == 0, cli.stderr
    answer = httpx.post(f"{api.url}/v1/jobs", json={**one, "name": "one-fixed", "lora": job_dict("x", data, 1)["lora"]},
                        headers=api.auth(), timeout=120)
    assert answer.status_code == 201, answer.text
    for record in api.ray.jobs():
        if record.name in ("fine", "typo-fixed", "one-fixed") and record.state not in ("completed", "failed"):
            api.ray.cancel(record.id)


def test_post_sweeps_and_aspen_sweep_refuse_a_typod_target_module_of_the_job_or_the_space(api, layer_names, tmp_path):
    data = write_task_data(tmp_path / "data", "qa", rows=24)

    def sweep_file(name: str, targets: list[str], space: str) -> Path:
        job = job_dict("qa", data, 2, eval_split=4, eval_every=2)
        job["lora"] = {**job["lora"], "target_modules": targets}
        lines = [f"name: {name}", f"base_model: {api.base}", f"output_dir: {tmp_path / name}", "step_tokens: 512",
                 "search: grid", "max_concurrent: 1", f"space: {space}", "job:"]
        lines += [f"  {key}: {json.dumps(value)}" for key, value in job.items()]
        path = tmp_path / f"{name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path

    before = api.table()
    in_job = sweep_file("typo", ["q_proj", "o_projj"], "{lr: {choice: [0.001, 0.002]}}")
    answer = httpx.post(f"{api.url}/v1/sweeps", content=in_job.read_text(), headers={**api.auth(), **YAML},
                        timeout=120)
    assert answer.status_code == 422 and answer.json().get("errors"), answer.text
    (error,) = answer.json()["errors"]
    lora_line = next(n for n, line in enumerate(in_job.read_text().splitlines(), 1) if line.startswith("  lora:"))
    assert error["loc"] == ["job", "lora", "target_modules", 1] and error["line"] == lora_line, error
    assert error["msg"] == typo_message(layer_names, "o_projj", "o_proj"), error

    in_space = sweep_file("space-typo", ["q_proj"], "{lora.target_modules: {choice: [[q_proj], [k_prj, v_proj]]}}")
    answer = httpx.post(f"{api.url}/v1/sweeps", content=in_space.read_text(), headers={**api.auth(), **YAML},
                        timeout=120)
    assert answer.status_code == 422 and answer.json().get("errors"), answer.text
    (error,) = answer.json()["errors"]
    assert error["loc"] == ["space", "lora.target_modules", "choice", 1, 0] and error["line"] == 7, error
    assert error["msg"] == typo_message(layer_names, "k_prj", "k_proj"), error
    assert api.table() == before and not {"typo", "space-typo"} & {s["name"] for s in api.ray.sweeps()}

    cli = aspen("sweep", str(in_space), "--url", api.url, api=api)
    assert cli.returncode == 2, (cli.stdout, cli.stderr)
    assert (f"aspen: invalid sweep file:\n{in_space}:7: field space.lora.target_modules.choice.1: "
            f"{typo_message(layer_names, 'k_prj', 'k_proj')}\n(nothing was started") in cli.stderr, cli.stderr
    assert api.table() == before and "space-typo" not in {s["name"] for s in api.ray.sweeps()}

    fine = sweep_file("fine-targets", ["q_proj"], "{lora.target_modules: {choice: [[q_proj], [k_proj, v_proj]]}}")
    answer = httpx.post(f"{api.url}/v1/sweeps", content=fine.read_text(), headers={**api.auth(), **YAML}, timeout=120)
    assert answer.status_code == 201, answer.text
    api.ray.cancel_sweep("fine-targets")


def test_the_check_runs_off_the_event_loop_once_per_base(api, tmp_path, monkeypatch):
    """While a base is built on `meta` (held here until the test lets it go), the server answers other requests; a
    second submission on that base reads it no more, until the base's config changes."""
    base = tmp_path / "another-base"
    shutil.copytree(api.base, base)
    data = write_task_data(tmp_path / "data", "qa")
    body = {**job_dict("typo", data, 2), "base_model": str(base)}
    body["lora"] = {**body["lora"], "target_modules": ["q_projj"]}
    started, release, calls = threading.Event(), threading.Event(), []
    real_run = subprocess.run

    def held_run(*args, **kwargs):
        calls.append(args)
        started.set()
        assert release.wait(60)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(target_layers.subprocess, "run", held_run)
    answers = []
    sender = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(), timeout=120)))
    sender.start()
    try:
        assert started.wait(60)
        meanwhile = httpx.get(f"{api.url}/v1/jobs", headers=api.auth(), timeout=5)   # the loop is free
        assert meanwhile.status_code == 200
    finally:
        release.set()
        sender.join(120)
    assert answers[0].status_code == 422 and len(calls) == 1, answers[0].text
    again = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(), timeout=120)
    assert again.status_code == 422 and again.json()["errors"] == answers[0].json()["errors"] and len(calls) == 1
    config = base / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    assert httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(), timeout=120).status_code == 422
    assert len(calls) == 2


def test_a_gguf_base_of_an_architecture_aspen_does_not_train_is_refused_and_a_replaced_one_followed(api, tmp_path):
    """A GGUF file transformers converts but aspen trains no model of (bloom) is refused 422 naming its architecture
    and those aspen trains, nothing entered; the same file replaced by a phi3 one (its modification time kept, as
    `cp -p` keeps it) takes phi3's fused `qkv_proj`, the names transformers' converter gives it (the reference)."""
    from tests.helpers.gguf_files import converter_names, write_gguf
    from tests.helpers.model_families import build_config

    path = tmp_path / "base.gguf"
    write_gguf(path, "bloom", 2, {"token_embd": 2, "blk.0.attn_qkv": 2, "blk.1.attn_qkv": 2})
    data = write_task_data(tmp_path / "data", "qa")
    body = {**job_dict("bloom", data, 2), "base_model": str(path)}
    body["lora"] = {**body["lora"], "target_modules": ["qkv_proj"]}
    before = api.table()
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(), timeout=120)
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["errors"]
    assert error["field"] == "lora.target_modules.0" and "architecture 'bloom'" in error["msg"], error
    assert "llama, qwen2" in error["msg"] and "phi3" in error["msg"], error
    assert api.table() == before

    stat = path.stat()
    table, linear, dims = converter_names("phi3", "phi3")
    write_gguf(path, "phi3", build_config("phi3").num_hidden_layers, dims)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert any(name.endswith(".qkv_proj") for name in linear)
    body["lora"] = {**body["lora"], "target_modules": ["qkv_proj", "q_proj"]}
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(), timeout=120)
    assert answer.status_code == 422, answer.text
    (error,) = answer.json()["errors"]   # phi3 has qkv_proj, no q_proj
    assert error["target"] == "q_proj" and "did you mean 'qkv_proj'" in error["msg"], error
    assert api.table() == before
