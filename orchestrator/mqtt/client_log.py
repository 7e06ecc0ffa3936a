"""Where the MQTT client library's own log lines go (aiomqtt's, and paho's through it): to a logger of
aspen's at DEBUG whatever their level. The service's publisher (`orchestrator.mqtt.connection`, logger
`orchestrator.mqtt.client`) and `aspen watch --events` (`orchestrator.watch.mqtt`) each say in one line of
their own what happened to the connection; paho's `ERROR mqtt: failed to receive on socket ...` came right
beside it."""

from __future__ import annotations

import logging
from typing import Any


class AtDebug(logging.LoggerAdapter):
    """paho's and aiomqtt's own log lines, at DEBUG whatever their level."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.debug(msg, *args, **kwargs)


def client_logger(name: str) -> AtDebug:
    """The `logger=` to give aiomqtt.Client: its lines (and paho's) at DEBUG on logger `name`."""
    return AtDebug(logging.getLogger(name))


PUBLISHER_LOG = "orchestrator.mqtt.client"   # the service publisher's MQTT client, shown at DEBUG
