"""`aspen watch --events` (the real CLI process) while a real mosquitto stops and starts again: it says the
broker went away, reconnects with backoff, says it is back and prints the events published after the
restart (by the service's real publisher, an MqttListener on that broker); with the broker away longer than
--reconnect-for it exits 2 saying so; Ctrl-C while it waits for the broker ends it quietly."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path

from actors.service.scheduler.config import EventsConfig
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import persistent_settings, start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_listener import JOB, record
from tests.helpers.mqtt_watcher import Watcher
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def reader_file(state_dir: Path, port: int) -> Path:
    """The reader settings a service writes, pointing at the test's mosquitto (anonymous: any account passes)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "mqtt-reader.json").write_text(json.dumps({
        "url": f"mqtt://127.0.0.1:{port}", "topic_prefix": "aspen/v1", "username": "aspen-reader",
        "password": "unused"}))
    return state_dir


def watching(state_dir: Path, *extra: str) -> Watcher:
    return Watcher("watch", "--events", "--state-dir", str(state_dir), *extra)


def job_messages(watcher: Watcher) -> list[dict]:
    """The job messages a `--json` watcher printed, parsed."""
    return [m for m in (json.loads(line) for line in list(watcher.out)) if "/jobs/" in m["topic"]]


class Restarts:
    """A real mosquitto (in tmp_path/broker: persistent or not), the service's publisher on it (a real
    MqttListener) and an `aspen watch --events` process reading it; the broker can be stopped and started again."""

    def __init__(self, tmp_path: Path, *extra: str, persistent: bool = False):
        self.port = free_port()
        self.folder = tmp_path / "broker"
        self.folder.mkdir()
        self.persistent = persistent
        self.broker = self.start()
        self.listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{self.port}"))
        self.watcher = watching(reader_file(tmp_path / "state", self.port), *extra)
        self.code: int | None = None

    def start(self) -> subprocess.Popen:
        settings = persistent_settings(self.folder, self.port) if self.persistent else None
        self.broker = start_mosquitto(self.folder, self.port, settings)
        return self.broker

    def first_state_seen_then_broker_stopped(self) -> None:
        """The service publishes a running state, the `--json` watcher prints it, then the broker stops."""
        self.listener.job_changed(record("running", step=3), "queued")
        wait_for(lambda: job_messages(self.watcher), timeout=30,
                 what=f"the first state: {self.watcher.out} {self.watcher.err}")
        stop_mosquitto(self.broker)

    def end(self) -> None:
        self.code = self.watcher.end()
        self.listener.close()
        stop_mosquitto(self.broker)


@contextlib.contextmanager
def restarts(tmp_path: Path, *extra: str, persistent: bool = False):
    """`Restarts`, everything in it ended (the watcher's exit code in `.code`) however the test leaves."""
    scene = Restarts(tmp_path, *extra, persistent=persistent)
    try:
        yield scene
    finally:
        scene.end()


def test_watch_events_survives_a_broker_restart_and_prints_what_comes_after(tmp_path):
    with restarts(tmp_path) as scene:
        listener, watcher, port = scene.listener, scene.watcher, scene.port
        listener.job_changed(record("running", step=3), "queued")
        wait_for(lambda: any(JOB in line and "running" in line for line in watcher.out), timeout=30,
                 what=f"the first state in the watcher's output: {watcher.out} {watcher.err}")
        stop_mosquitto(scene.broker)
        gone = wait_for(lambda: watcher.said("went away"), timeout=20,
                        what=f"the watcher to say the broker went away: {watcher.err}")
        assert f"mqtt://127.0.0.1:{port}" in gone[0] and "reconnecting" in gone[0], gone
        time.sleep(2)     # a few failed attempts: the watcher must still be there
        assert watcher.process.poll() is None, watcher.err
        scene.start()
        back = wait_for(lambda: watcher.said("is back"), timeout=30,
                        what=f"the watcher to say the broker is back: {watcher.err}")
        assert f"mqtt://127.0.0.1:{port}" in back[0], back
        wait_for(lambda: listener.connection.connected, timeout=30, what="the publisher to reconnect")
        listener.job_changed(record("completed", step=10), "running")
        wait_for(lambda: any(JOB in line and "running -> completed" in line and "step 10/10" in line
                             for line in watcher.out), timeout=20,
                 what=f"the state published after the restart in the watcher's output: {watcher.out} {watcher.err}")
    errors = "".join(watcher.err)
    assert scene.code == 0, errors
    assert "Traceback" not in errors and "Task exception" not in errors, errors


def test_events_published_while_the_broker_restarts_reach_the_watcher_in_order_once(tmp_path):
    """A mosquitto that keeps its sessions across a restart (persistence true): the transitions the service
    publishes while it is down wait in the service, go to the broker when it is back, and the watcher (its
    session kept) prints each once, in order, after the state it had; the repeats (the retained state sent
    again at the watcher's new subscription, the service's own again at its connect) are left out."""
    with restarts(tmp_path, "--json", persistent=True) as scene:
        listener, watcher = scene.listener, scene.watcher
        scene.first_state_seen_then_broker_stopped()
        wait_for(lambda: watcher.said("went away") and listener.connection.down, timeout=20,
                 what=f"the watcher and the service to notice the broker left: {watcher.err}")
        assert "keeps this watch's session" in watcher.said("went away")[0], watcher.err
        listener.decided("move", JOB, "from trainer-0 to trainer-1")      # published while the broker is down
        listener.decided("preempt", JOB, "a higher priority job")
        listener.job_changed(record("completed", step=10), "running")
        time.sleep(1)
        scene.start()
        wait_for(lambda: len(job_messages(watcher)) >= 4, timeout=30,
                 what=f"the events published while the broker was down: {watcher.out} {watcher.err}")
        wait_for(lambda: listener.connection.connected and watcher.said("is back"), timeout=30,
                 what=f"both back: {watcher.err}")
        time.sleep(2)      # the repeats, if any, come by now
    errors = "".join(watcher.err)
    assert scene.code == 0, errors
    assert "kept this watch's session" in watcher.said("is back")[0], errors
    got = job_messages(watcher)
    assert [(m["topic"].split("/")[-1], m["payload"].get("state") or m["payload"].get("kind"), m["retained"])
            for m in got] == [("state", "running", True), ("events", "moved", False),
                              ("events", "preempted", False), ("state", "completed", False)], got
    seqs = [m["payload"]["seq"] for m in got]
    assert seqs == sorted(set(seqs)), seqs        # in the order the service made them, each once
    assert got[-1]["payload"]["previous"] == "running"
    printed = [json.loads(line) for line in watcher.out]
    keys = [(m["topic"], m["payload"]["publisher"], m["payload"]["seq"]) for m in printed if m["payload"]]
    assert len(keys) == len(set(keys)), printed   # the service's status (and its last will) once each too
    # one client id for the whole watch, its session kept (c0) at each connect, and ended (c1) when it left
    sessions = re.findall(r"New client connected from \S+ as (aspen-watch-\w+) \(p\d, c(\d)",
                          (scene.folder / "mosquitto.log").read_text())
    assert len({identifier for identifier, _ in sessions}) == 1, sessions
    assert [clean for _, clean in sessions] == ["0", "0", "1"], sessions
    assert "Traceback" not in errors, errors


def test_a_broker_restarted_without_persistence_says_what_may_be_missed(tmp_path):
    with restarts(tmp_path, "--json") as scene:    # persistence false: its sessions go with it
        listener, watcher = scene.listener, scene.watcher
        scene.first_state_seen_then_broker_stopped()
        wait_for(lambda: watcher.said("went away"), timeout=20, what=f"the watcher to notice: {watcher.err}")
        scene.start()
        back = wait_for(lambda: watcher.said("is back"), timeout=30, what=f"the watcher to be back: {watcher.err}")
        assert "without this watch's session" in back[0] and "restarted without persistence" in back[0], back
        assert "may be missed" in back[0], back
        wait_for(lambda: listener.connection.connected, timeout=30, what="the service to reconnect")
        listener.job_changed(record("completed", step=10), "running")
        wait_for(lambda: len(job_messages(watcher)) >= 2, timeout=30,
                 what=f"the state published after the restart: {watcher.out} {watcher.err}")
        time.sleep(1)
    assert scene.code == 0, "".join(watcher.err)
    # the service published the running state again (the broker lost it), but it is the one printed already
    got = job_messages(watcher)
    assert [(m["payload"]["state"], m["retained"]) for m in got] == [("running", True), ("completed", False)], got


def test_watch_events_gives_up_after_reconnect_for_seconds_without_the_broker(tmp_path):
    port = free_port()
    broker = start_mosquitto(tmp_path / "broker", port)
    watcher = watching(reader_file(tmp_path / "state", port), "--reconnect-for", "3")
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
    watcher = watching(reader_file(tmp_path / "state", port))
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
