"""A real mosquitto broker for the tests, and an MQTT subscriber that records what arrives."""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest

from actors.service.table.job_table import JobRecord
from tests.helpers.service import wait_for


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
                                              if os.access(p, os.X_OK)), None)


def require_mosquitto() -> str:
    """The mosquitto binary; without it the test skips, or fails under CI (CI=true), where .ci/run installs it."""
    binary = mosquitto_binary()
    if binary is None:
        message = "mosquitto is not installed (apt-get install mosquitto)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return binary


def start_mosquitto(folder: Path, port: int, settings: str | None = None, tls_port: int | None = None
                    ) -> subprocess.Popen:
    """A real mosquitto on 127.0.0.1:`port` (anonymous unless `settings` say otherwise), listening (also on
    `tls_port` when given) when this returns."""
    binary = require_mosquitto()
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "mosquitto.conf"
    config.write_text(settings or f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    with (folder / "mosquitto.log").open("a") as log_file:
        process = subprocess.Popen([binary, "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT)

    def accepting() -> bool:
        assert process.poll() is None, (folder / "mosquitto.log").read_text()
        for listening in (port, tls_port or port):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", listening)) != 0:
                    return False
        return True

    try:
        wait_for(accepting, timeout=20, what="mosquitto to listen")
    except BaseException:
        stop_mosquitto(process)
        raise
    return process


def persistent_settings(folder: Path, port: int) -> str:
    """A mosquitto that keeps its sessions and retained messages across a restart (saved to `folder` when it
    stops) and logs every packet (`received_publishes` reads them)."""
    # as root, mosquitto drops to the user 'mosquitto', who cannot write the test's private folder
    return (f"user {getpass.getuser()}\nlistener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {folder}/\nlog_type all\n")


def received_publishes(folder: Path) -> list[str]:
    """The topics of the PUBLISH packets the mosquitto started in `folder` received, in order, as its log
    says (all its runs there: `log_type all`, as `persistent_settings` sets)."""
    log = (folder / "mosquitto.log").read_text()
    return re.findall(r"Received PUBLISH from \S+ \(d\d, q\d, r\d, m\d+, '([^']*)'", log)


def stop_mosquitto(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=10)


SUBSCRIBE_WAIT_S = 30.0


class Subscriber:
    """An aiomqtt client in a thread of its own, subscribed to `topic`; records (topic, payload, retain),
    the payload parsed from JSON (None for an empty one: a retained message being cleared)."""

    def __init__(self, port: int, topic: str = "aspen/v1/#", username: str | None = None,
                 password: str | None = None):
        self.port, self.topic, self.username, self.password = port, topic, username, password
        self.messages: list[tuple[str, dict, bool]] = []
        self.subscribed = threading.Event()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        # 30 s: the embedded broker is a thread of the test's own process, which shares two cores with the
        # other test worker's processes (a pipeline test runs three); 10 s was once not enough
        assert self.subscribed.wait(SUBSCRIBE_WAIT_S), f"subscriber could not subscribe on port {port}: {self.error!r}"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as error:  # noqa: BLE001 - reported by close()
            self.error = error
            self.subscribed.set()

    async def _main(self) -> None:
        async with aiomqtt.Client("127.0.0.1", self.port, identifier=f"test-{uuid.uuid4().hex[:8]}",
                                  username=self.username, password=self.password) as client:
            await client.subscribe(self.topic, qos=1)
            self.subscribed.set()

            async def read() -> None:
                async for message in client.messages:
                    payload = json.loads(message.payload) if message.payload else None
                    self.messages.append((str(message.topic), payload, bool(message.retain)))

            reader = asyncio.create_task(read())
            while not self.stopping.is_set():
                await asyncio.sleep(0.05)
            reader.cancel()

    def on(self, topic: str) -> list[tuple[dict, bool]]:
        return [(payload, retain) for t, payload, retain in list(self.messages) if t == topic]

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        if self.error is not None:
            raise self.error


def retained(port: int, topic: str, wait: float = 10, **credentials: str) -> dict:
    """What a subscriber connecting now gets as the retained message of `topic`."""
    late = Subscriber(port, topic, **credentials)
    try:
        found = wait_for(lambda: late.on(topic), timeout=wait, what=f"a retained message on {topic}")
    finally:
        late.close()
    payload, was_retained = found[0]
    assert was_retained
    return payload


def retained_states(port: int, prefix: str, present: str, settle: float = 0.5, **credentials: str) -> dict[str, dict]:
    """The retained job states (job id -> payload) that a subscriber to `<prefix>/jobs/#` connecting now
    gets: waits for job `present`'s, then `settle` seconds for the others (the broker sends them together)."""
    late = Subscriber(port, f"{prefix}/jobs/#", **credentials)
    try:
        wait_for(lambda: late.on(f"{prefix}/jobs/{present}/state"), timeout=10, what=f"the retained state of {present}")
        time.sleep(settle)
    finally:
        late.close()
    states = {}
    for topic, payload, was_retained in list(late.messages):
        if was_retained and topic.endswith("/state"):
            assert payload is not None, topic    # a cleared retained message is gone, not kept with no payload
            states[topic.split("/")[-2]] = payload
    return states


def job_record(job_id: str, state: str, finished_at: float | None = None) -> JobRecord:
    now = time.time()
    return JobRecord(id=job_id, name=job_id, state=state, reason="why", base_model="m", quantization="none", priority=0,
                     output_dir="/out", trainer=None, step=3, total_steps=10, tokens=300, loss=1.5, eval_loss=None,
                     tokens_per_s=20.0, checkpoint_step=None, adapter_dir=None, submitted_at=now, started_at=now,
                     finished_at=finished_at, updated_at=finished_at or now)
