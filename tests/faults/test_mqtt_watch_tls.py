"""`aspen watch --events` (the real CLI process) against a real mosquitto with only a TLS listener, its
certificate signed by a CA the test makes: with the service's YAML (`--config`: an external mqtts:// broker
and its events.ca_file) or a reader file naming a `ca_file`, the watcher connects over TLS as the service's
real publisher does and prints what it publishes; a CA that did not sign the broker's certificate, or one
that is missing, exits 2 naming the setting and the fix; asking the service instead says to use --config.
A connection the broker drops with a reset is said in aspen's one line on stderr (the MQTT client's own
`failed to receive on socket` only with --debug)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from actors.service.scheduler.config import EventsConfig
from orchestrator.client import Client
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_listener import JOB, record
from tests.helpers.mqtt_tls import ResettingRelay, make_ca, tls_broker_settings
from tests.helpers.mqtt_watcher import Watcher
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for


def service_yaml(folder: Path, port: int, ca_file: Path) -> Path:
    """The service YAML of a service publishing to the external broker over TLS."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "service.yaml"
    path.write_text(f"state_dir: {folder / 'state'}\nevents:\n  broker: mqtts://127.0.0.1:{port}\n"
                    f"  ca_file: {ca_file}\n")
    return path


def test_watch_events_follows_an_external_broker_over_tls(tmp_path):
    port = free_port()
    folder = tmp_path / "broker"
    settings, ca_file = tls_broker_settings(folder, port)
    broker = start_mosquitto(folder, port, settings)
    listener = MqttListener(EventsConfig(broker=f"mqtts://127.0.0.1:{port}", ca_file=ca_file))
    state_dir = tmp_path / "reader"    # a reader file naming the CA, relative to its folder
    state_dir.mkdir()
    (state_dir / "ca.pem").write_bytes(ca_file.read_bytes())
    (state_dir / "mqtt-reader.json").write_text(json.dumps({
        "url": f"mqtts://127.0.0.1:{port}", "topic_prefix": "aspen/v1", "username": "aspen-reader",
        "password": "unused", "ca_file": "ca.pem"}))
    watchers = [Watcher("watch", "--events", "--json", "--config", str(service_yaml(tmp_path / "svc", port, ca_file))),
                Watcher("watch", "--events", "--json", "--state-dir", str(state_dir))]
    try:
        for watcher in watchers:
            wait_for(lambda w=watcher: w.said("Ctrl-C to leave"), timeout=30, what=f"the watcher: {watcher.err}")
        wait_for(lambda: listener.connection.connected, timeout=30, what="the service's publisher over TLS")
        described = listener.describe()
        listener.job_changed(record("running", step=3), "queued")
        for watcher in watchers:
            got = wait_for(lambda w=watcher: [m for m in map(json.loads, list(w.out)) if JOB in m["topic"]],
                           timeout=30, what=f"the job's state over TLS: {watcher.out} {watcher.err}")
            assert got[0]["payload"]["state"] == "running" and got[0]["payload"]["previous"] == "queued", got
    finally:
        codes = [watcher.end() for watcher in watchers]
        listener.close()
        stop_mosquitto(broker)
    for watcher, code in zip(watchers, codes, strict=True):
        assert code == 0, watcher.err
        assert "Traceback" not in "".join(watcher.err), watcher.err
    # without --config, `aspen watch --events` asks the service (Client.event_settings), which has no reader
    # file for an external broker: it says to follow it with the service's YAML
    client = Client.__new__(Client)
    client.info = lambda: {**described, "state_dir": str(tmp_path / "svc" / "state")}
    with pytest.raises(FileNotFoundError) as refused:
        client.event_settings()
    assert f"the external broker mqtts://127.0.0.1:{port}" in str(refused.value), refused.value
    assert "aspen watch --events --config SERVICE_YAML" in str(refused.value), refused.value
    # the broker has only its TLS listener: the watchers' sessions were there (each its connect and its end)
    clients = re.findall(r"New client connected from \S+ as (aspen-watch-\w+)", (folder / "mosquitto.log").read_text())
    assert len(set(clients)) == 2, clients


def test_a_ca_that_did_not_sign_the_brokers_certificate_or_a_missing_one_is_named(tmp_path):
    port = free_port()
    folder = tmp_path / "broker"
    settings, _ = tls_broker_settings(folder, port)
    broker = start_mosquitto(folder, port, settings)
    other_ca, _, _ = make_ca(tmp_path / "other", "other-ca")
    try:
        wrong = Watcher("watch", "--events", "--config", str(service_yaml(tmp_path / "wrong", port, other_ca)))
        missing = Watcher("watch", "--events", "--config",
                          str(service_yaml(tmp_path / "missing", port, tmp_path / "nowhere.pem")))
        codes = [wrong.process.wait(timeout=30), missing.process.wait(timeout=30)]
        wrong.end(), missing.end()
    finally:
        stop_mosquitto(broker)
    assert codes == [2, 2], (wrong.err, missing.err)
    said = wrong.err[-1]
    yaml_file = tmp_path / "wrong" / "service.yaml"
    assert said.startswith("aspen: the certificate of the MQTT broker at mqtts://127.0.0.1:") and \
        "does not verify" in said, wrong.err
    assert str(other_ca) in said and f"set events.ca_file in {yaml_file} to the PEM file of the CA" in said, said
    said = missing.err[-1]
    assert said.startswith(f"aspen: events.ca_file in {tmp_path / 'missing' / 'service.yaml'}: ") and \
        f"{tmp_path / 'nowhere.pem'} does not exist" in said, missing.err
    for watcher in (wrong, missing):
        assert "Traceback" not in "".join(watcher.err) and "ERROR" not in "".join(watcher.err), watcher.err
    # an external broker that is not there: about the broker, not the embedded one
    nobody = free_port()
    absent = Watcher("watch", "--events", "--config", str(service_yaml(tmp_path / "absent", nobody, other_ca)))
    assert absent.process.wait(timeout=30) == 2, absent.err
    absent.end()
    assert absent.err[-1].startswith(f"aspen: cannot follow the job events at mqtts://127.0.0.1:{nobody} (from "), \
        absent.err
    assert "Is the broker running there, and does it admit this account?" in absent.err[-1], absent.err


def test_a_dropped_connection_is_said_in_aspens_one_line(tmp_path):
    """The broker's side drops the connection with a reset (through a relay): paho logs `failed to receive
    on socket` at ERROR; the watcher says the broker went away in its own line, paho's only at DEBUG (with
    --debug). (Over TLS the reset comes as a plain end of the connection: paho says nothing.)"""
    port, relayed = free_port(), free_port()
    folder = tmp_path / "broker"
    broker = start_mosquitto(folder, port, f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                                           "log_type all\n")
    config = tmp_path / "service.yaml"
    config.write_text(f"events:\n  broker: mqtt://127.0.0.1:{relayed}\n")
    ended = []
    try:
        for count, debug in enumerate(((), ("--debug",)), start=1):
            relay = ResettingRelay(relayed, port)
            watcher = Watcher(*debug, "watch", "--events", "--reconnect-for", "1", "--config", str(config))
            wait_for(lambda n=count: (folder / "mosquitto.log").read_text().count("jobs/+/events (QoS 1)") == n,
                     timeout=30, what=f"the watcher's subscriptions: {watcher.err}")
            time.sleep(0.5)    # their SUBACKs through the relay
            relay.reset()
            assert watcher.process.wait(timeout=30) == 2, watcher.err
            watcher.end()
            ended.append(watcher.err)
    finally:
        stop_mosquitto(broker)
    quiet, debugged = ended
    assert [line.split(" ", 4)[:4] for line in quiet] == [
        ["job", "events", "from", f"mqtt://127.0.0.1:{relayed}"],
        ["aspen:", "the", "MQTT", "broker"], ["aspen:", "the", "MQTT", "broker"]], quiet
    assert "went away" in quiet[1] and "has been away for" in quiet[2], quiet
    paho = [line for line in debugged if "failed to receive on socket" in line]
    assert paho and paho[0].startswith("DEBUG orchestrator.watch.mqtt: failed to receive on socket: "), debugged
    assert not [line for line in debugged if line.startswith("ERROR")], debugged
