"""`aspen watch --events` (the real CLI process) while a real mosquitto stops and starts again: it says the
broker went away, reconnects with backoff, says it is back and prints the events published after the
restart (by the service's real publisher, an MqttListener on that broker); with the broker away longer than
--reconnect-for it exits 2 saying so; Ctrl-C while it waits for the broker ends it quietly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from actors.service.scheduler.config import EventsConfig
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_listener import JOB, record
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def reader_file(state_dir: Path, port: int) -> Path:
    """The reader settings a service writes, pointing at the test's mosquitto (anonymous: any account passes)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "mqtt-reader.json").write_text(json.dumps({
        "url": f"mqtt://127.0.0.1:{port}", "topic_prefix": "aspen/v1", "username": "aspen-reader",
        "password": "unused"}))
    return state_dir


class Watcher:
    """`aspen watch --events --state-dir ...` as a real process, its stdout and stderr lines collected."""

    def __init__(self, state_dir: Path, *extra: str):
        aspen = Path(sys.executable).with_name("aspen")
        self.process = subprocess.Popen([str(aspen), "watch", "--events", "--state-dir", str(state_dir), *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=lambda s=s, t=t: t.extend(iter(s.readline, "")), daemon=True)
                        for s, t in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def said(self, text: str) -> list[str]:
        return [line for line in list(self.err) if text in line]

    def end(self, timeout: float = 20) -> int:
        """Ctrl-C unless it ended already; its exit code (killed where it does not end within `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            for reader in self.readers:
                reader.join(5)


def test_watch_events_survives_a_broker_restart_and_prints_what_comes_after(tmp_path):
    port = free_port()
    broker = start_mosquitto(tmp_path / "broker", port)
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}"))
    watcher = Watcher(reader_file(tmp_path / "state", port))
    try:
        listener.job_changed(record("running", step=3), "queued")
        wait_for(lambda: any(JOB in line and "running" in line for line in watcher.out), timeout=30,
                 what=f"the first state in the watcher's output: {watcher.out} {watcher.err}")
        stop_mosquitto(broker)
        gone = wait_for(lambda: watcher.said("went away"), timeout=20,
                        what=f"the watcher to say the broker went away: {watcher.err}")
        assert f"mqtt://127.0.0.1:{port}" in gone[0] and "reconnecting" in gone[0], gone
        time.sleep(2)     # a few failed attempts: the watcher must still be there
        assert watcher.process.poll() is None, watcher.err
        broker = start_mosquitto(tmp_path / "broker", port)
        back = wait_for(lambda: watcher.said("is back"), timeout=30,
                        what=f"the watcher to say the broker is back: {watcher.err}")
        assert f"mqtt://127.0.0.1:{port}" in back[0], back
        wait_for(lambda: listener.connection.connected, timeout=30, what="the publisher to reconnect")
        listener.job_changed(record("completed", step=10), "running")
        wait_for(lambda: any(JOB in line and "running -> completed" in line and "step 10/10" in line
                             for line in watcher.out), timeout=20,
                 what=f"the state published after the restart in the watcher's output: {watcher.out} {watcher.err}")
    finally:
        code = watcher.end()
        listener.close()
        stop_mosquitto(broker)
    errors = "".join(watcher.err)
    assert code == 0, errors
    assert "Traceback" not in errors and "Task exception" not in errors, errors


def test_watch_events_gives_up_after_reconnect_for_seconds_without_the_broker(tmp_path):
    port = free_port()
    broker = start_mosquitto(tmp_path / "broker", port)
    watcher = Watcher(reader_file(tmp_path / "state", port), "--reconnect-for", "3")
    try:
        wait_for(lambda: watcher.said("Ctrl-C to leave"), timeout=30, what=f"the watcher to start: {watcher.err}")
        time.sleep(1)    # subscribed (nothing is published here: the broker is empty)
    finally:
        stop_mosquitto(broker)
    started = time.monotonic()
    code = watcher.process.wait(timeout=30)
    waited = time.monotonic() - started
    watcher.end()
    errors = "".join(watcher.err)
    assert code == 2, errors
    assert 2.5 <= waited < 20, (waited, errors)
    last = watcher.err[-1]
    assert f"mqtt://127.0.0.1:{port}" in last and "away for" in last and "--reconnect-for" in last, errors
    assert "Traceback" not in errors, errors


def test_ctrl_c_while_the_watcher_waits_for_the_broker_ends_it_quietly(tmp_path):
    port = free_port()
    broker = start_mosquitto(tmp_path / "broker", port)
    watcher = Watcher(reader_file(tmp_path / "state", port))
    try:
        wait_for(lambda: watcher.said("Ctrl-C to leave"), timeout=30, what=f"the watcher to start: {watcher.err}")
        time.sleep(1)
    finally:
        stop_mosquitto(broker)
    wait_for(lambda: watcher.said("went away"), timeout=20, what=f"the watcher to notice: {watcher.err}")
    code = watcher.end()
    errors = "".join(watcher.err)
    assert code == 0, errors
    assert "Traceback" not in errors, errors
