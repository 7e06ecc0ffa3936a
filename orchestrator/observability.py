"""The service's listeners, built from its configuration: the Prometheus endpoint (`metrics`) and the MQTT
job events (`events`). The scheduler actor calls them (`actors.core.listeners`)."""

from __future__ import annotations

from actors.core.config import ServiceConfig
from actors.core.listeners import ServiceListener


def service_listeners(config: ServiceConfig) -> list[ServiceListener]:
    listeners: list[ServiceListener] = []
    if config.metrics.enabled:
        from orchestrator.metrics import MetricsListener

        listeners.append(MetricsListener(config.metrics))
    if config.events.enabled:
        from orchestrator.events import MqttListener

        listeners.append(MqttListener(config.events, service_info={"policy": config.policy,
                                                                   "state_dir": str(config.state_dir)}))
    return listeners
