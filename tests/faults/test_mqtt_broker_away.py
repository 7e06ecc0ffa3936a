"""The service's MQTT publisher (a real MqttListener) while a real mosquitto restarts: what the service
publishes meanwhile waits in its outbox and reaches the broker in order when it is back (the broker's own
log says what it received); beyond the outbox's size the oldest non-retained messages are dropped, counted
(`mqtt_dropped`, what `aspen serve` and `client.info()` show) and said in the service's log. A connection
reset is said in the service's one line (the MQTT client's own lines at DEBUG).
tests/faults/test_mqtt_watch_reconnect.py checks that a watcher gets them."""

from __future__ import annotations

import io
import logging
import re

from actors.service.scheduler.config import EventsConfig
from orchestrator.mqtt.client_log import PUBLISHER_LOG
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import job_record, persistent_settings, received_publishes, start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_tls import ResettingRelay
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def test_a_full_outbox_drops_the_oldest_events_counts_and_says_so_and_publishes_the_rest_in_order(tmp_path, caplog):
    port = free_port()
    folder = tmp_path / "broker"
    folder.mkdir()
    broker = start_mosquitto(folder, port, persistent_settings(folder, port))
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{port}"), queue_size=3)
    try:
        wait_for(lambda: listener.connection.connected, timeout=10, what="the listener to connect")
        stop_mosquitto(broker)
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            wait_for(lambda: listener.connection.down, timeout=20, what="the listener to notice the broker left")
            listener.job_changed(job_record("job-s", "running"), "queued")   # retained: kept before any event
            for n in range(4):                          # the outbox holds 3: the first two events go
                listener.decided("preempt", f"job-{n}", "a higher priority job")
            assert (listener.describe()["mqtt_waiting"], listener.describe()["mqtt_dropped"]) == ("3", "2")
            broker = start_mosquitto(folder, port, persistent_settings(folder, port))
            wait_for(lambda: listener.connection.published == 3, timeout=30, what="what waited to be published")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        dropped = [w for w in warnings if "dropped 1 MQTT event(s)" in w]
        assert len(dropped) == 1, warnings              # rate-limited: one warning for both
        assert "the queue is full" in dropped[0] and f"mqtt://127.0.0.1:{port}" in dropped[0], dropped
        assert "keeps the last 3 messages while the broker is away" in dropped[0], dropped
        [back] = [w for w in warnings if "reconnected" in w]
        assert re.fullmatch(rf"events: reconnected to mqtt://127\.0\.0\.1:{port} after \d+ s away; publishing the 3 "
                            r"event\(s\) that waited, in order; 2 event\(s\) were dropped meanwhile .*", back), back
        assert (listener.describe()["mqtt_waiting"], listener.describe()["mqtt_dropped"]) == ("0", "2")
        jobs = [topic for topic in received_publishes(folder) if "/jobs/" in topic]
        assert jobs == ["aspen/v1/jobs/job-s/state", "aspen/v1/jobs/job-2/events", "aspen/v1/jobs/job-3/events"], jobs
    finally:
        listener.close()
        stop_mosquitto(broker)


def test_a_dropped_connection_is_said_in_the_services_one_line(tmp_path):
    """A broker whose connection drops with a reset (through a relay): the service's log, formatted as the
    scheduler actor's (`LEVEL logger: message`, INFO and up), has aspen's own line that the broker is away,
    not paho's `ERROR mqtt: failed to receive on socket`, which goes to orchestrator.mqtt.client at DEBUG."""
    port, relayed = free_port(), free_port()
    folder = tmp_path / "broker"
    broker = start_mosquitto(folder, port, f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    relay = ResettingRelay(relayed, port)
    text, debug = io.StringIO(), io.StringIO()
    service_log = logging.StreamHandler(text)
    service_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))   # SchedulerActor's
    service_log.setLevel(logging.INFO)
    client_log = logging.StreamHandler(debug)
    client_log.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root, client_logger = logging.getLogger(), logging.getLogger(PUBLISHER_LOG)
    level, client_level = root.level, client_logger.level
    root.addHandler(service_log)
    client_logger.addHandler(client_log)
    root.setLevel(logging.INFO)
    client_logger.setLevel(logging.DEBUG)
    listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{relayed}"))
    try:
        wait_for(lambda: listener.connection.connected, timeout=10, what="the listener to connect")
        relay.reset()
        wait_for(lambda: "unreachable" in text.getvalue(), timeout=20, what=f"the service's line: {text.getvalue()}")
    finally:
        listener.close()
        root.removeHandler(service_log)
        client_logger.removeHandler(client_log)
        root.setLevel(level)
        client_logger.setLevel(client_level)
        stop_mosquitto(broker)
    lines = text.getvalue().splitlines()
    assert not [line for line in lines if line.startswith("ERROR")], lines
    assert [line for line in lines if line.startswith(
        f"WARNING orchestrator.mqtt.listener: events: MQTT broker mqtt://127.0.0.1:{relayed} unreachable (")], lines
    paho = [line for line in debug.getvalue().splitlines() if "failed to receive on socket" in line]
    assert paho and paho[0].startswith("DEBUG orchestrator.mqtt.client: failed to receive on socket: "), paho
