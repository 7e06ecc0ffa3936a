"""A connection reset during the MQTT handshake (a relay in front of a real mosquitto passes the client's
CONNECT on and resets the client before the broker's CONNACK reaches it) is noticed at once: by the service's
publisher (its warning that the broker is unreachable comes within seconds, not after aiomqtt's 10 s
timeout) and by `aspen watch --events` (the real CLI exits 2 at once, saying so). A reset right after the
CONNACK (aiomqtt's `__aenter__` dropped its disconnection future unread) fails the connect, or leaves it to
end inside, and leaves no `Future exception was never retrieved` behind."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import aiomqtt

from actors.service.scheduler.config import EventsConfig
from orchestrator.mqtt.handshake import HandshakeClient
from orchestrator.mqtt.listener import MqttListener
from tests.helpers.mqtt import start_mosquitto, stop_mosquitto
from tests.helpers.mqtt_tls import HandshakeResetter
from tests.helpers.mqtt_watcher import Watcher
from tests.helpers.ports import free_port
from tests.helpers.service import wait_for

SETTINGS = "listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"


def test_a_reset_during_the_handshake_is_noticed_at_once(tmp_path, caplog):
    port, relayed = free_port(), free_port()
    broker = start_mosquitto(tmp_path / "broker", port, SETTINGS.format(port=port))
    relay = HandshakeResetter(relayed, port)
    config = tmp_path / "service.yaml"
    config.write_text(f"events:\n  broker: mqtt://127.0.0.1:{relayed}\n")
    listener = None
    try:
        started = time.monotonic()
        watcher = Watcher("watch", "--events", "--config", str(config))
        code = watcher.process.wait(timeout=30)
        watched_s = time.monotonic() - started
        watcher.end()
        with caplog.at_level(logging.WARNING, logger="orchestrator.mqtt.listener"):
            started = time.monotonic()
            listener = MqttListener(EventsConfig(broker=f"mqtt://127.0.0.1:{relayed}"))
            wait_for(lambda: "unreachable" in caplog.text, timeout=30, what="the publisher's warning")
            published_s = time.monotonic() - started
    finally:
        if listener is not None:
            listener.close()
        relay.close()
        stop_mosquitto(broker)
    assert relay.connects >= 2, relay.connects     # the broker got both CONNECTs
    assert code == 2 and watched_s < 8, (code, watched_s, watcher.err)   # aiomqtt's timeout: 10 s
    assert watcher.err[-1].startswith(f"aspen: cannot follow the job events at mqtt://127.0.0.1:{relayed} (from "), \
        watcher.err
    assert "the connection was closed or reset during the MQTT handshake, before the broker's CONNACK" in \
        watcher.err[-1], watcher.err
    assert not [line for line in watcher.err if "ERROR" in line or "Traceback" in line], watcher.err
    assert published_s < 8, published_s
    [warning] = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert "during the MQTT handshake" in warning, warning


def test_a_reset_right_after_the_connack_leaves_no_unread_future(tmp_path, caplog):
    port, relayed = free_port(), free_port()
    broker = start_mosquitto(tmp_path / "broker", port, SETTINGS.format(port=port))
    relay = HandshakeResetter(relayed, port, after_connack=True)
    outcomes = []

    async def connect_five_times() -> None:
        for _ in range(5):
            try:
                async with HandshakeClient("127.0.0.1", relayed, timeout=10):
                    await asyncio.sleep(0.2)   # the connection ends inside
                outcomes.append("entered")
            except aiomqtt.MqttError as error:
                outcomes.append(str(error))
            gc.collect()

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(connect_five_times())
            gc.collect()
    finally:
        relay.close()
        stop_mosquitto(broker)
    assert relay.connects == 5, relay.connects
    assert set(outcomes) <= {"entered", "the connection was closed or reset right after the MQTT handshake (the "
                                        "broker's CONNACK came, then the connection ended)"}, outcomes
    assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
