"""`aspen watch --events` against the service's real embedded broker: it follows the events with only the
state dir's reader account (plain lines, or one JSON object per event with --json), says where credentials
are missing, and, end to end through Ray, `Client.event_settings` finds them for a real job's states."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.service.scheduler.config import ServiceConfig, TrainerConfig
from orchestrator.cli import main as aspen_main
from orchestrator.client import Client
from orchestrator.watch import watch_events
from tests.helpers.mqtt_listener import JOB, listening, record
from tests.helpers.service import job_dict, wait_for, write_task_data


@pytest.fixture
def service(tmp_path):
    """A real MqttListener with its embedded broker, the victim job's state published: (listener, state dir)."""
    with listening(tmp_path) as served:
        yield served


def interrupt(process: subprocess.Popen, collector: threading.Thread) -> int:
    """Ctrl-C to `aspen watch --events`; its exit code (killed if it does not end within 15 s)."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
        collector.join(5)


@pytest.mark.parametrize("given", ["--state-dir", "--config"])
def test_aspen_watch_events_follows_the_service_with_the_state_dirs_reader_account(service, given, tmp_path):
    """With the state dir, or the service's YAML naming it (`events.broker: embedded`, the default)."""
    listener, state_dir = service
    config = tmp_path / "service.yaml"
    config.write_text(f"state_dir: {state_dir}\npolicy: fifo\n")
    aspen = Path(sys.executable).with_name("aspen")
    process = subprocess.Popen([str(aspen), "watch", "--events", given,
                                str(state_dir if given == "--state-dir" else config)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    collector = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    collector.start()
    try:
        wait_for(lambda: any(JOB in line and "running (retained)" in line for line in lines), timeout=30,
                 what=f"the retained state in aspen watch --events' output: {lines}")
        listener.job_changed(record("completed", step=10), "running")
        wait_for(lambda: any(JOB in line and "running -> completed" in line and "step 10/10" in line
                             for line in lines), timeout=15, what=f"the state change in the output: {lines}")
    finally:
        code = interrupt(process, collector)
    errors = process.stderr.read()
    assert code == 0, errors
    assert "Traceback" not in errors and "Task exception" not in errors, errors
    assert any("service online" in line for line in lines), lines


def test_aspen_watch_events_json_prints_one_object_per_event(service):
    listener, state_dir = service
    aspen = Path(sys.executable).with_name("aspen")
    process = subprocess.Popen([str(aspen), "watch", "--events", "--json", "--state-dir", str(state_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    collector = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    collector.start()

    def events() -> list[dict]:
        return [json.loads(line) for line in list(lines)]   # every line is one JSON object

    try:
        state_topic = f"aspen/v1/jobs/{JOB}/state"
        retained = wait_for(lambda: [e for e in events() if e["topic"] == state_topic and e["retained"]],
                            timeout=30, what=f"the retained state as JSON: {lines}")
        assert retained[0]["payload"]["state"] == "running"
        listener.job_changed(record("completed", step=10), "running")
        changed = wait_for(lambda: [e for e in events() if e["topic"] == state_topic and not e["retained"]
                                    and e["payload"]["state"] == "completed"], timeout=15,
                           what=f"the state change as JSON: {lines}")
        assert changed[0]["payload"]["previous"] == "running" and changed[0]["payload"]["step"] == 10
    finally:
        code = interrupt(process, collector)
    assert code == 0, process.stderr.read()


def test_aspen_watch_events_says_where_the_credentials_are_missing(tmp_path, capsys):
    assert aspen_main(["watch", "--events", "--state-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"the service's MQTT credentials are not in {tmp_path}" in error
    assert "embedded broker" in error and "can you read its state dir" in error


def test_a_real_jobs_states_reach_watch_events_through_client_event_settings(ray_session, tiny_model_dirs,
                                                                              tmp_path):
    base = tiny_model_dirs["llama"]
    trainer = TrainerConfig(base_model=str(base), step_tokens=512, num_cpus=0.5, threads=1)
    config = ServiceConfig(state_dir=tmp_path / "state", trainers=[trainer], tick_seconds=0.1,
                           metrics={"enabled": False}, events={"embedded_port": 0})
    client = Client.local(config)
    stop = threading.Event()
    lines: list[str] = []
    failures: list[BaseException] = []

    def follow() -> None:
        try:
            watch_events(settings, out=lines.append, stop=stop)
        except BaseException as error:  # noqa: BLE001 - the test reports it
            failures.append(error)

    follower = threading.Thread(target=follow, daemon=True)
    try:
        settings = client.event_settings()
        info = client.info()
        assert (settings.url, str(settings.source)) == (info["mqtt_url"], info["mqtt_credentials"])
        assert settings.username == "aspen-reader"
        follower.start()
        wait_for(lambda: failures or any("service online" in line for line in lines), timeout=30,
                 what="the watcher to subscribe")
        assert not failures, failures
        job = client.submit(job_dict("watched", write_task_data(tmp_path / "data", "watched"), 3),
                            base_model=str(base))
        assert job.wait(timeout=120).state == "completed"
        mine = wait_for(lambda: [line for line in lines if job.id in line and "-> completed" in line] and
                        [line for line in lines if job.id in line], timeout=30, what="the completed state")
        assert any("queued -> running" in line for line in mine), mine
        assert not failures, failures
    finally:
        stop.set()
        follower.join(10)
        client.shutdown()
