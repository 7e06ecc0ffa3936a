"""Job events over MQTT: `MqttListener` hears the scheduler (a `ServiceListener`) and publishes each job's
state changes, progress and notable events, plus the service's own online/offline status, to an MQTT
broker: an embedded amqtt broker started with the service (default), or an external one.

Two parts, each in its module: what to publish (`orchestrator.mqtt.topics`: the topics, payloads and
retained states) and the connection that publishes it (`orchestrator.mqtt.connection`: a daemon thread
with its own asyncio loop, the embedded broker, reconnects with backoff; `orchestrator.mqtt.outbox`: the
bounded queue). The scheduler's calls only put messages in the outbox: while the broker is unreachable
they wait there, to be published in order when it is back; a full outbox drops its oldest progress and
events first, with a (rate-limited) warning, and training goes on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.service.scheduler.config import EventsConfig
from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent, TrainerStatus
from orchestrator.mqtt.connection import MqttConnection
from orchestrator.mqtt.outbox import QUEUE_SIZE
from orchestrator.mqtt.settings import parse_broker_url, tls_context
from orchestrator.mqtt.topics import EventTopics, topic_prefix


class MqttListener:
    """Publishes the service's job events to MQTT: `topics` says what, `connection` sends it."""

    def __init__(self, config: EventsConfig, *, state_dir: str | Path | None = None,
                 service_info: dict[str, Any] | None = None, queue_size: int = QUEUE_SIZE,
                 start_timeout: float = 10.0):
        """`state_dir`: the service's state folder, where the embedded broker keeps its accounts (required
        with `broker: embedded`, unused with an external broker)."""
        prefix = topic_prefix(config.topic_prefix)
        self.embedded = config.broker == "embedded"
        state_dir = Path(state_dir).expanduser() if state_dir is not None else None
        address = None
        if self.embedded and state_dir is None:
            raise ValueError("events.broker 'embedded': the broker keeps its accounts in the service's state dir; "
                             "pass state_dir to MqttListener (service_listeners does)")
        if not self.embedded:
            address = parse_broker_url(config.broker, config.username, config.password)
            tls_context(address.tls, config.ca_file, "events.ca_file")   # a missing or bad CA file: said now
        self.topics = EventTopics(prefix, retain_finished_s=config.retain_finished_s, service_info=service_info)
        self.connection = MqttConnection(config, self.topics, address=address, state_dir=state_dir,
                                         queue_size=queue_size, start_timeout=start_timeout)

    # -- ServiceListener ----------------------------------------------------------------------------------
    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        self.connection.send(self.topics.job_changed(record, previous))

    def job_deleted(self, job_id: str) -> None:
        """The job is gone: clear its retained state."""
        self.connection.send(self.topics.job_deleted(job_id))

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        self.connection.send(self.topics.trainer_polled(events))

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        self.connection.send(self.topics.decided(kind, job_id, reason))

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        """States of jobs from before the service started, and the clearing of finished jobs whose retention
        ran out (`EventTopics.tick`; the embedded broker starts empty: nothing of it to clear)."""
        self.connection.send(self.topics.tick(jobs, clear_unknown=not self.embedded))

    def describe(self) -> dict[str, str]:
        connection = self.connection
        if connection.disabled:
            return {"events_error": connection.broker_error} if connection.broker_error else {}
        if connection.address is None:
            return {}
        described = {"mqtt_url": connection.address.url, "mqtt_topics": f"{self.topics.prefix}/#",
                     "mqtt_connected": "yes" if connection.connected else "no",
                     "mqtt_waiting": str(len(connection.outbox)),            # events not published yet
                     "mqtt_dropped": str(connection.outbox.dropped_total)}   # events dropped from a full outbox
        if connection.reader_file is not None:
            described["mqtt_credentials"] = str(connection.reader_file)
        return described

    def close(self) -> None:
        """Publish the retained `offline` status, disconnect, stop the embedded broker (waits a few
        seconds at most)."""
        self.connection.close()
