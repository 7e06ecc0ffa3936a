"""MQTT job events, checked by a real subscriber (an aiomqtt client in the test): against a real mosquitto
started by the test and against the service's embedded amqtt broker (subscribing there with the reader
account from the service's state dir), a job's states, progress and events arrive, late subscribers get the
retained state and service status, a stopped service leaves a retained `offline`, a listener whose
broker is down neither blocks nor stops anything and publishes what waited when it is back, and retained
states are cleared when a job is deleted and once a finished job's retention (events.retain_finished_s)
ran out. tests/faults/test_mqtt_auth.py checks who may connect, publish and subscribe on the embedded
broker; tests/faults/test_mqtt_broker_away.py what waits, and what a full queue drops, while it is away."""

from __future__ import annotations

import getpass
import json
import logging
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from actors.service.scheduler.config import EventsConfig, ServiceConfig
from actors.service.table.job_table import JobRecord
from orchestrator.client import Client
from orchestrator.mqtt.listener import MqttListener
from orchestrator.mqtt.settings import reader_settings
from orchestrator.mqtt.topics import topic_level
from orchestrator.report import write_report
from tests.helpers.mqtt import (
    Subscriber,
    job_record,
    persistent_settings,
    received_publishes,
    require_mosquitto,
    retained,
    retained_states,
    start_mosquitto,
    stop_mosquitto,
)
from tests.helpers.ports import free_port
from tests.helpers.service import job_dict, wait_for, write_task_data
from tests.helpers.service import service_config as shared_service_config


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory):
    """A real mosquitto for the module; yields its port."""
    port = free_port()
    process = start_mosquitto(tmp_path_factory.mktemp("mosquitto"), port)
    try:
        yield port
    finally:
        stop_mosquitto(process)


def service_config(state_dir: Path, base: Path, events: dict) -> ServiceConfig:
    return shared_service_config(state_dir, base, listeners={"events": events})


def check_job_lifecycle(subscriber: Subscriber, client: Client, job_id: str, steps: int) -> None:
    prefix = f"aspen/v1/jobs/{job_id}"
    wait_for(lambda: any(p["state"] == "completed" for p, _ in subscriber.on(f"{prefix}/state")),
             timeout=30, what="the completed state on MQTT")
    states = [p["state"] for p, _ in subscriber.on(f"{prefix}/state")]
    assert states == ["queued", "running", "completed"], states
    assert all(p["job"] == job_id for p, _ in subscriber.on(f"{prefix}/state"))
    def progress_rows() -> list[dict]:
        return [p for p, retain in subscriber.on(f"{prefix}/progress") if not retain]

    wait_for(lambda: len(progress_rows()) >= steps, timeout=10, what=f"{steps} progress messages on MQTT")
    progress = progress_rows()
    # what the subscriber saw, in order: every step's progress before the completed state (a broker may hold
    # a QoS 1 message back behind unacknowledged ones, never a QoS 0 one: the state cannot come early)
    seen = [(topic.rsplit("/", 1)[1], payload) for topic, payload, retain in list(subscriber.messages)
            if topic.startswith(f"{prefix}/") and not retain]
    completed_at = next(i for i, (kind, p) in enumerate(seen) if kind == "state" and p["state"] == "completed")
    assert [p["step"] for kind, p in seen[completed_at:] if kind == "progress"] == [], seen
    assert [p["step"] for p in progress] == list(range(1, steps + 1))
    table = {row["step"]: row["loss"] for row in client.losses(job_id)}   # the service's own record
    assert all(p["loss"] == pytest.approx(table[p["step"]]) and p["tokens_per_s"] > 0 and p["total_steps"] == steps
               for p in progress)


def test_topic_levels_cannot_contain_wildcards_or_separators():
    assert topic_level("a+b/c#d-1f2e3a") == "a_b_c_d-1f2e3a"
    assert topic_level("ok.name_1-abc123") == "ok.name_1-abc123"
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{free_port()}", topic_prefix="lab/aspen/"))
    try:
        assert listener.topics.job_topic("x/+#-00ff", "state") == "lab/aspen/jobs/x___-00ff/state"
    finally:
        listener.close()
    with pytest.raises(ValueError, match="events.topic_prefix"):
        MqttListener(EventsConfig(topic_prefix="aspen/#"))
    with pytest.raises(ValueError, match="events.broker"):
        MqttListener(EventsConfig(broker="http://127.0.0.1:1883"))


def test_a_dead_broker_never_blocks_and_warns(caplog):
    port = free_port()   # nothing listens there
    record = JobRecord(id="job-abc123", name="job", state="running", reason="training", base_model="m",
                       quantization="none", priority=0, output_dir="/out", trainer="trainer-0", step=3, total_steps=10,
                       tokens=300, loss=1.5, eval_loss=None, tokens_per_s=20.0, checkpoint_step=None, adapter_dir=None,
                       submitted_at=time.time(), started_at=time.time(), finished_at=None, updated_at=time.time())
    with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
        listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}"), queue_size=100)
        try:
            started = time.perf_counter()
            for _ in range(5000):
                listener.job_changed(record, "queued")
                listener.decided("preempt", record.id, "a higher priority job")
            assert time.perf_counter() - started < 2.0
            assert len(listener.connection.outbox) <= 100
            wait_for(lambda: listener.connection.down, timeout=10, what="the listener to notice the broker is down")
            listener.job_changed(record, "queued")
        finally:
            started = time.perf_counter()
            listener.close()
            assert time.perf_counter() - started < 5.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"mqtt://127.0.0.1:{port}" in w and "unreachable" in w for w in warnings), warnings
    assert len(warnings) <= 3, warnings    # rate-limited, not one per event


def test_the_listener_reconnects_and_publishes_the_latest_states_again(tmp_path, caplog):
    port = free_port()
    broker = start_mosquitto(tmp_path / "broker", port)
    record = JobRecord(id="job-abc123", name="job", state="running", reason="training", base_model="m",
                       quantization="none", priority=0, output_dir="/out", trainer="trainer-0", step=3, total_steps=10,
                       tokens=300, loss=1.5, eval_loss=None, tokens_per_s=20.0, checkpoint_step=None, adapter_dir=None,
                       submitted_at=time.time(), started_at=time.time(), finished_at=None, updated_at=time.time())
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}"))
    try:
        listener.job_changed(record, "queued")
        listener.job_changed(job_record("job-def456", "queued"), None)
        wait_for(lambda: listener.connection.published >= 2, timeout=10, what="the first states to be published")
        stop_mosquitto(broker)           # persistence off: the restarted broker has no retained messages
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            wait_for(lambda: listener.connection.down, timeout=20, what="the listener to notice the broker left")
            record.state, record.step = "completed", 10
            listener.job_changed(record, "running")     # waits: the broker is away
            listener.job_deleted("job-def456")          # waits too, after it
        assert listener.connection.outbox.unsent_clears == {"job-def456"}
        broker = start_mosquitto(tmp_path / "broker", port)
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            wait_for(lambda: listener.connection.connected, timeout=30, what="the listener to reconnect")
            back = wait_for(lambda: [r.getMessage() for r in caplog.records if "reconnected" in r.getMessage()],
                            timeout=10, what="the reconnect's summary")
        assert re.fullmatch(rf"events: reconnected to mqtt://127\.0\.0\.1:{port} after \d+ s away; publishing the 2 "
                            r"event\(s\) that waited, in order; 0 event\(s\) were dropped meanwhile", back[0]), back
        state = retained(port, "aspen/v1/jobs/job-abc123/state")
        assert (state["state"], state["step"]) == ("completed", 10)
        assert set(retained_states(port, "aspen/v1", "job-abc123")) == {"job-abc123"}   # the deleted one is not back
        wait_for(lambda: not listener.connection.outbox.unsent_clears, timeout=10,
                 what="the clearing that waited to be sent")
        assert retained(port, "aspen/v1/service/status")["state"] == "online"
        assert any("unreachable" in r.getMessage() for r in caplog.records)
    finally:
        listener.close()
        stop_mosquitto(broker)


def test_a_message_cut_short_by_the_brokers_going_is_published_when_it_is_back(tmp_path):
    """A job event being published (its acknowledgement awaited) when the broker dies is not lost: it goes
    first when the broker is back (as the broker's own log says), and nothing counts in `mqtt_dropped`
    (what `aspen serve` and `client.info()` show)."""
    port = free_port()
    folder = tmp_path / "broker"
    folder.mkdir()
    broker = start_mosquitto(folder, port, persistent_settings(folder, port))
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}"))
    topic = "aspen/v1/jobs/job-abc123/events"
    try:
        wait_for(lambda: listener.connection.connected, timeout=10, what="the listener to connect")
        assert listener.describe()["mqtt_dropped"] == "0"
        broker.send_signal(signal.SIGSTOP)          # a broker that hangs: the event's PUBACK never comes
        listener.decided("preempt", "job-abc123", "a higher priority job")
        wait_for(lambda: not len(listener.connection.outbox), timeout=10, what="the event to be taken from the outbox")
        time.sleep(0.5)                             # written to the broker's socket, its acknowledgement awaited
        assert listener.connection.published == 0
        broker.kill()                               # then it dies: the connection breaks mid-publish
        broker.wait(timeout=10)
        wait_for(lambda: listener.connection.down, timeout=20, what="the listener to notice the broker left")
        assert len(listener.connection.outbox) == 1 and listener.describe()["mqtt_dropped"] == "0"
        broker = start_mosquitto(folder, port, persistent_settings(folder, port))
        wait_for(lambda: listener.connection.published == 1, timeout=30, what="the event to be published again")
        assert received_publishes(folder).count(topic) == 1, received_publishes(folder)
        assert listener.describe()["mqtt_dropped"] == "0"
    finally:
        listener.close()
        if broker.poll() is None:
            broker.kill()


def test_an_external_broker_over_tls_with_a_password(tmp_path, caplog):
    require_mosquitto()   # and its mosquitto_passwd, from the same package
    folder = tmp_path / "tls"
    folder.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem")], check=True, capture_output=True)
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(folder / "passwords"), "aspen", "s3cret"], check=True,
                   capture_output=True)
    plain, tls = free_port(), free_port()
    # as root, mosquitto drops to the user 'mosquitto', who cannot read the test's private folder
    settings = (f"user {getpass.getuser()}\nper_listener_settings false\nallow_anonymous false\npassword_file "
                f"{folder / 'passwords'}\n"
                f"persistence false\nlistener {plain} 127.0.0.1\nlistener {tls} 127.0.0.1\n"
                f"certfile {folder / 'cert.pem'}\nkeyfile {folder / 'key.pem'}\n")
    broker = start_mosquitto(folder, plain, settings, tls_port=tls)
    record = JobRecord(id="job-abc123", name="job", state="completed", reason="done", base_model="m",
                       quantization="none", priority=0, output_dir="/out", trainer=None, step=10, total_steps=10,
                       tokens=300, loss=1.5, eval_loss=None, tokens_per_s=20.0, checkpoint_step=None, adapter_dir=None,
                       submitted_at=time.time(), started_at=time.time(), finished_at=time.time(),
                       updated_at=time.time())
    try:
        listener = MqttListener(EventsConfig(broker=f"mqtts://127.0.0.1:{tls}", username="aspen", password="s3cret",
                                             ca_file=folder / "cert.pem"))
        try:
            assert listener.describe()["mqtt_url"] == f"mqtts://127.0.0.1:{tls}"
            listener.job_changed(record, "running")
            wait_for(lambda: listener.connection.published >= 1, timeout=10, what="a publish over TLS")
        finally:
            listener.close()
        assert retained(plain, "aspen/v1/jobs/job-abc123/state", username="aspen", password="s3cret")["state"] == \
            "completed"
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            wrong = MqttListener(EventsConfig(broker=f"mqtts://127.0.0.1:{tls}", username="aspen", password="wrong",
                                              ca_file=folder / "cert.pem"))
            try:
                wait_for(lambda: wrong.connection.down, timeout=10, what="a refused password to be noticed")
            finally:
                wrong.close()
        assert any("unreachable" in r.getMessage() and f"mqtts://127.0.0.1:{tls}" in r.getMessage()
                   for r in caplog.records)
    finally:
        stop_mosquitto(broker)


@pytest.mark.parametrize("broker", ["mosquitto", "embedded"])
def test_a_deleted_jobs_retained_state_is_cleared(broker, request, tmp_path):
    prefix = f"test-{uuid.uuid4().hex[:8]}/v1"
    if broker == "mosquitto":
        port = request.getfixturevalue("mosquitto")
        listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}", topic_prefix=prefix))
        credentials: dict[str, str] = {}
    else:
        listener = MqttListener(EventsConfig(embedded_port=0, topic_prefix=prefix), state_dir=tmp_path)
        reader = reader_settings(tmp_path)
        port, credentials = reader.port, {"username": reader.username, "password": reader.password}
    try:
        kept, deleted = job_record("kept-000001", "queued"), job_record("gone-000002", "completed", time.time())
        listener.job_changed(kept, None)
        listener.job_changed(deleted, "running")
        wait_for(lambda: listener.connection.published >= 2, timeout=10, what="the states to be published")
        assert set(retained_states(port, prefix, kept.id, **credentials)) == {kept.id, deleted.id}

        live = Subscriber(port, f"{prefix}/jobs/#", **credentials)
        wait_for(lambda: len(live.messages) >= 2, timeout=10, what="the retained states at the live subscriber")
        listener.job_deleted(deleted.id)
        cleared = wait_for(lambda: [p for p, _ in live.on(f"{prefix}/jobs/{deleted.id}/state") if p is None],
                           timeout=10, what="the clearing at the live subscriber")
        assert len(cleared) == 1
        live.close()
        assert set(retained_states(port, prefix, kept.id, **credentials)) == {kept.id}
        # not published again at a reconnect
        assert [m.topic for m in listener.topics.retained_states()] == [listener.topics.job_topic(kept.id, "state")]
    finally:
        listener.close()


def test_finished_jobs_retained_states_are_cleared_after_the_retention(mosquitto):
    prefix = f"test-{uuid.uuid4().hex[:8]}/v1"
    url = f"mqtt://127.0.0.1:{mosquitto}"
    old = job_record("old-000001", "failed", time.time() - 3600)    # finished long before the restart
    earlier = MqttListener(EventsConfig(broker=url, topic_prefix=prefix, retain_finished_s=None))
    try:   # the service's previous run, which kept finished states
        earlier.job_changed(old, "running")
        wait_for(lambda: earlier.connection.published >= 1, timeout=10, what="the old job's state to be published")
    finally:
        earlier.close()
    assert retained(mosquitto, f"{prefix}/jobs/{old.id}/state")["state"] == "failed"

    listener = MqttListener(EventsConfig(broker=url, topic_prefix=prefix, retain_finished_s=1.0))
    live = Subscriber(mosquitto, f"{prefix}/jobs/#")
    try:
        running = job_record("run-000002", "running")
        listener.job_changed(running, "queued")
        done = job_record("done-000003", "completed", time.time())
        listener.job_changed(done, "running")
        listener.tick([old, running, done], {}, [])      # the first round after the start: every job
        wait_for(lambda: [p for p, _ in live.on(f"{prefix}/jobs/{old.id}/state") if p is None], timeout=10,
                 what="the old job's state to be cleared at the first round")
        assert set(retained_states(mosquitto, prefix, running.id)) == {running.id, done.id}

        time.sleep(1.2)
        for _ in range(3):                                # later rounds: the unfinished jobs only
            listener.tick([running], {}, [])
        wait_for(lambda: [p for p, _ in live.on(f"{prefix}/jobs/{done.id}/state") if p is None], timeout=10,
                 what="the finished job's state to be cleared after its retention")
        assert set(retained_states(mosquitto, prefix, running.id)) == {running.id}
        assert [m.topic for m in listener.topics.retained_states()] == [listener.topics.job_topic(running.id, "state")]
        cleared = [t.split("/")[-2] for t, p, _ in list(live.messages) if p is None]
        assert sorted(cleared) == sorted([done.id, old.id])      # each cleared once
    finally:
        live.close()
        listener.close()


def test_embedded_broker_on_a_taken_port_warns_and_names_the_fix(caplog, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            listener = MqttListener(EventsConfig(embedded_port=port), state_dir=tmp_path)
        try:
            assert listener.describe() == {}
            listener.job_changed(JobRecord(id="j-1", name="j", state="queued", reason="submitted", base_model="m",
                                           quantization="none", priority=0, output_dir="/o", trainer=None, step=0,
                                           total_steps=None, tokens=0, loss=None, eval_loss=None, tokens_per_s=None,
                                           checkpoint_step=None, adapter_dir=None, submitted_at=0.0, started_at=None,
                                           finished_at=None, updated_at=0.0), None)
        finally:
            listener.close()
    message = " ".join(r.getMessage() for r in caplog.records)
    assert f"127.0.0.1:{port}" in message and "events.embedded_port" in message and "events.broker" in message


def test_job_events_on_a_real_mosquitto(ray_session, mosquitto, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs["llama"]
    url = f"mqtt://127.0.0.1:{mosquitto}"
    client = Client.local(service_config(tmp_path / "state", base, {"broker": url}))
    stopped = False
    try:
        assert client.info()["mqtt_url"] == url
        live = Subscriber(mosquitto)
        data = tmp_path / "data"
        job = client.submit(job_dict("plain", write_task_data(data, "plain"), 6), base_model=str(base))
        # a stop rule that can never be satisfied: stops at its 4th evaluation (patience 1 + 3)
        stopper = client.submit(job_dict("stopper", write_task_data(data, "stopper", offset=2), 60, eval_every=1,
                                         early_stop={"min_improvement": 5.0, "patience": 1}), base_model=str(base))
        assert job.wait(timeout=120).state == "completed"
        ended = stopper.wait(timeout=120)
        assert ended.state == "stopped_early", ended
        check_job_lifecycle(live, client, job.id, 6)

        events = f"aspen/v1/jobs/{stopper.id}/events"
        early = wait_for(lambda: [p for p, _ in live.on(events) if p["kind"] == "stopped_early"], timeout=20,
                         what="the stopped_early event")
        assert early[0]["reason"] == ended.reason and early[0]["job"] == stopper.id
        states = [p["state"] for p, _ in live.on(f"aspen/v1/jobs/{stopper.id}/state")]
        assert states[-1] == "stopped_early"
        status = live.on("aspen/v1/service/status")
        assert status and status[-1][0]["state"] == "online" and status[-1][0]["policy"] == "adaptive"
        live.close()

        # a subscriber that comes after the fact gets the retained state and service status
        assert retained(mosquitto, f"aspen/v1/jobs/{job.id}/state")["state"] == "completed"
        assert retained(mosquitto, "aspen/v1/service/status")["state"] == "online"

        # deleting a job clears its retained state
        assert retained(mosquitto, f"aspen/v1/jobs/{stopper.id}/state")["state"] == "stopped_early"
        client.delete(stopper.id)
        wait_for(lambda: stopper.id not in retained_states(mosquitto, "aspen/v1", job.id), timeout=10,
                 what="the deleted job's retained state to be cleared")

        client.shutdown()
        stopped = True
        offline = retained(mosquitto, "aspen/v1/service/status")
        assert offline["state"] == "offline" and offline["reason"] == "shutdown"
        assert retained(mosquitto, f"aspen/v1/jobs/{job.id}/state")["state"] == "completed"
    finally:
        if not stopped:
            client.shutdown()


def test_job_events_on_the_embedded_broker(ray_session, tiny_model_dirs, tmp_path):
    base = tiny_model_dirs["llama"]
    client = Client.local(service_config(tmp_path / "state", base, {"broker": "embedded", "embedded_port": 0}))
    try:
        url = client.info()["mqtt_url"]
        assert url.startswith("mqtt://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1])
        assert port != 0
        reader = reader_settings(tmp_path / "state")    # what a subscriber on this machine reads
        assert (reader.url, reader.username) == (url, "aspen-reader")
        credentials = {"username": reader.username, "password": reader.password}
        live = Subscriber(port, **credentials)
        job = client.submit(job_dict("embedded", write_task_data(tmp_path / "data", "embedded"), 5),
                            base_model=str(base))
        assert job.wait(timeout=120).state == "completed"
        check_job_lifecycle(live, client, job.id, 5)
        live.close()
        assert retained(port, f"aspen/v1/jobs/{job.id}/state", **credentials)["state"] == "completed"
        assert retained(port, "aspen/v1/service/status", **credentials)["state"] == "online"
    finally:
        client.shutdown()
    with socket.socket() as probe:   # the embedded broker stopped with the service
        assert probe.connect_ex(("127.0.0.1", port)) != 0

    # aspen report on the service's state folder (outputs/<job id>/metrics.jsonl, jobs.sqlite)
    png, markdown = write_report(tmp_path / "state")
    metrics = [json.loads(line) for line in
               (tmp_path / "state" / "outputs" / job.id / "metrics.jsonl").read_text().splitlines()]
    row = next(line for line in markdown.read_text().splitlines() if line.startswith(f"| {job.id} |"))
    assert row == f"| {job.id} | 5 | {metrics[-1]['loss']:.4f} | - | {sum(r['tokens'] for r in metrics)} | completed |"
    assert png.read_bytes()[:4] == b"\x89PNG"
