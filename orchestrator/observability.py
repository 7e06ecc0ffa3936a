"""The service's listeners, built from its configuration: the Prometheus endpoint (`metrics`) and the MQTT
job events (`events`; the embedded broker keeps its accounts in the service's state dir). The scheduler
actor calls them (`actors.service.events.listeners`)."""

from __future__ import annotations

from pathlib import Path

from actors.service.events.listeners import ServiceListener
from actors.service.scheduler.config import ServiceConfig


def service_listeners(config: ServiceConfig) -> list[ServiceListener]:
    listeners: list[ServiceListener] = []
    if config.metrics.enabled:
        from orchestrator.metrics import MetricsListener

        listeners.append(MetricsListener(config.metrics))
    if config.events.enabled:
        from orchestrator.mqtt.listener import MqttListener

        state_dir = Path(config.state_dir).expanduser()
        listeners.append(MqttListener(config.events, state_dir=state_dir,
                                      service_info={"policy": config.policy, "state_dir": str(state_dir)}))
    return listeners
