"""An aiomqtt client that notices at once a connection the broker (or the network) drops during the MQTT
handshake, for the service's publisher (`orchestrator.mqtt.connection`) and `aspen watch --events`.

aiomqtt 2.x (2.5.1 read) offers no hook for it: its `_on_disconnect` ignores a disconnection before the
CONNACK, so `async with Client(...)` waited its whole timeout (10 s) to say `Operation timed out`; and where
the connection dropped right after the CONNACK, its `__aenter__` replaced the future holding the
`MqttCodeError('Unexpected disconnection')` unread (asyncio's `ERROR asyncio: Future exception was never
retrieved` on stderr) and returned a client whose connection was gone. `HandshakeClient` overrides those
private parts (pinned aiomqtt>=2.5,<3): the first fails the connect at once, the second raises MqttError
with the future read."""

from __future__ import annotations

from typing import Any

import aiomqtt


class HandshakeClient(aiomqtt.Client):
    """aiomqtt.Client whose `async with` fails at once (MqttError) where the connection drops during the MQTT
    handshake or right after it, and that leaves no disconnection future unread."""

    _handshaking = False

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any, properties: Any = None) -> None:
        if self._handshaking and not self._connected.done():   # before the CONNACK: aiomqtt ignores it
            self._connected.set_exception(aiomqtt.MqttError(
                "the connection was closed or reset during the MQTT handshake, before the broker's CONNACK"))
            return
        super()._on_disconnect(client, userdata, flags, reason_code, properties)

    async def __aenter__(self) -> HandshakeClient:
        before = self._disconnected    # aiomqtt replaces it, unread, where it completed while entering
        fresh = not before.done()
        self._handshaking = True
        try:
            await super().__aenter__()
        except BaseException:
            self._read_disconnected()
            raise
        finally:
            self._handshaking = False
        if fresh and before is not self._disconnected and before.done() and not before.cancelled() \
                and before.exception() is not None:     # read: no 'Future exception was never retrieved'
            if self._lock.locked():
                self._lock.release()
            raise aiomqtt.MqttError("the connection was closed or reset right after the MQTT handshake (the broker's "
                                    "CONNACK came, then the connection ended)")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self._read_disconnected()   # a connection that dropped inside the `async with`: aiomqtt leaves it unread
        await super().__aexit__(*exc_info)

    def _read_disconnected(self) -> None:
        """The disconnection future's exception, if any, marked read (asyncio logs one never read)."""
        if self._disconnected.done() and not self._disconnected.cancelled():
            self._disconnected.exception()
