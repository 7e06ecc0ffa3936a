"""The service's side of MQTT for a test: a real MqttListener with its embedded broker on a free port,
connected with the service account and the victim job's `running` state published, and the reader account
that the state dir holds for `aspen watch --events`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from actors.service.scheduler.config import EventsConfig
from actors.service.table.job_table import JobRecord
from orchestrator.mqtt.listener import MqttListener
from orchestrator.mqtt.settings import reader_settings
from tests.helpers.service import wait_for

JOB = "victim-1a2b3c"


def record(state: str = "running", step: int = 3, job_id: str = JOB) -> JobRecord:
    now = time.time()
    return JobRecord(id=job_id, name="victim", state=state, reason="training", base_model="m", quantization="none",
                     priority=0, output_dir="/out", trainer="trainer-0", step=step, total_steps=10, tokens=0,
                     loss=1.5, eval_loss=None, tokens_per_s=None, checkpoint_step=None, adapter_dir=None,
                     submitted_at=now, started_at=now, finished_at=None, updated_at=now)


def reader_account(state_dir: Path) -> dict[str, str]:
    settings = reader_settings(state_dir)
    return {"username": settings.username, "password": settings.password}


@contextlib.contextmanager
def listening(tmp_path: Path) -> Iterator[tuple[MqttListener, Path]]:
    """A real MqttListener with its embedded broker on a free port, connected with the service account, the
    victim job's `running` state published; yields (listener, state dir)."""
    state_dir = tmp_path / "state"
    listener = MqttListener(EventsConfig(embedded_port=0), state_dir=state_dir)
    try:
        wait_for(lambda: listener.connection.connected, timeout=20, what="the service account to connect")
        listener.job_changed(record(), "queued")
        wait_for(lambda: listener.connection.published >= 1, timeout=10, what="the service to publish the job's state")
        yield listener, state_dir
    finally:
        listener.close()
