"""The service's listeners, built from its configuration: the Prometheus endpoint (`metrics`) and the MQTT
job events (`events`). The scheduler actor calls them (`actors.core.listeners`)."""

from __future__ import annotations

from actors.core.config import ServiceConfig
from actors.core.listeners import ServiceListener
from orchestrator.metrics import MetricsListener


def service_listeners(config: ServiceConfig) -> list[ServiceListener]:
    listeners: list[ServiceListener] = []
    if config.metrics.enabled:
        listeners.append(MetricsListener(config.metrics))
    return listeners
