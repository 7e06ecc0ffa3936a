"""The connection that carries the service's MQTT messages (`orchestrator.mqtt.topics`) to the broker.

The scheduler's threads only put messages in a bounded `Outbox` (`orchestrator.mqtt.outbox`); a daemon
thread runs its own asyncio loop: it starts the embedded amqtt broker where configured
(`orchestrator.mqtt.broker`), connects with aiomqtt and publishes the outbox in order, each message with
QoS 1 (taken off the outbox once the broker acknowledged it), reconnecting with backoff. While the broker
is unreachable the messages wait in the outbox (a full one drops its oldest non-retained message, with a
rate-limited warning) and training goes on. At each connect it publishes the retained `online` status,
the clearings dropped, and the last state of every job that has none waiting in the outbox, then the
outbox in order; its last will, and its last message when closed, is the retained `offline`.

External brokers (`events.broker: mqtt://...`) use `events.username`/`events.password` as configured;
the embedded one admits only the accounts the service generates (`orchestrator.mqtt.broker`)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.engine.extras import MissingExtraError, require
from actors.service.accounts.users import USERS_FILE
from actors.service.scheduler.config import EventsConfig
from orchestrator.mqtt.client_log import PUBLISHER_LOG, client_logger
from orchestrator.mqtt.outbox import QUEUE_SIZE, Outbox
from orchestrator.mqtt.settings import (
    CREDENTIALS_FILE,
    READER_FILE,
    BrokerAddress,
    broker_credentials,
    tls_context,
    write_reader_settings,
)
from orchestrator.mqtt.topics import EventTopics, Message

if TYPE_CHECKING:   # imported where the broker starts: amqtt is an extra
    from orchestrator.mqtt.broker import EmbeddedBroker

log = logging.getLogger("orchestrator.mqtt.listener")   # the events' one logger, whichever module logs

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
CLOSE_TIMEOUT_S = 5.0


class LoopThread:
    """A daemon thread that runs one asyncio loop: `loop` and `wake` (an asyncio.Event any thread may set through
    `wake_up`) once it runs, `stop_requested`, and `ready` / `finished` for the threads that wait on it."""

    def __init__(self, name: str):
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None
        self.stop_requested = False
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, main: Callable[[], Coroutine[Any, Any, None]], on_failure: Callable[[], None]) -> None:
        """Run `main()` on the thread's loop; `on_failure` after an exception (logged) ends it."""
        def run() -> None:
            try:
                asyncio.run(self._entered(main))
            except Exception:  # events must never stop the service; the error is logged
                log.exception("events: the MQTT thread failed; job events are off")
                on_failure()
            finally:
                self.ready.set()
                self.finished.set()

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()

    async def _entered(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        await main()

    def wake_up(self) -> None:
        """Set `wake` from any thread (nothing where the loop has not started or has closed)."""
        loop, wake = self.loop, self.wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:   # the loop has closed (the service is stopping): nothing left to wake
                log.debug("events: the MQTT loop has closed")

    async def sleep(self, seconds: float) -> None:
        """Up to `seconds`, less where woken."""
        assert self.wake is not None
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except TimeoutError:
            pass

    def join(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout=timeout)


class MqttConnection:
    """The publishing thread: its asyncio loop, the embedded broker (`address` None until it listens) or
    an external one (`address` given), and the connection to it. `connected`, `down`, `disabled` and
    `published` say how it goes."""

    def __init__(self, config: EventsConfig, topics: EventTopics, *, address: BrokerAddress | None,
                 state_dir: Path | None, queue_size: int = QUEUE_SIZE, start_timeout: float = 10.0):
        self.config = config
        self.topics = topics
        self.address = address
        self.state_dir = state_dir
        self.reader_file: Path | None = None     # written once the embedded broker listens
        self.outbox = Outbox(queue_size, address.url if address else "the embedded broker")
        self.connected = False
        self.disabled = False        # the embedded broker could not start: no events at all
        self.broker_error: str | None = None   # why not, where the user can act on it (a missing extra)
        self.published = 0
        self.away: tuple[float, int] | None = None   # since when the broker is away, and dropped_total then
        self.runner = LoopThread("mqtt-events")
        self.runner.start(self._main, on_failure=self._events_off)
        if not self.runner.ready.wait(start_timeout):
            log.warning("events: the MQTT thread did not start within %.0fs; events are queued until it does",
                        start_timeout)

    @property
    def down(self) -> bool:
        return self.outbox.down

    def send(self, messages: list[Message]) -> None:
        """Queue messages for the broker (from any thread; never blocks). While the broker is away they wait
        (the publisher's backoff is not cut short)."""
        if any([self.outbox.put(message) for message in messages]) and not self.outbox.down:   # a list: all put
            self.runner.wake_up()

    def close(self) -> None:
        """Publish the retained `offline` status, disconnect, stop the embedded broker (waits a few
        seconds at most)."""
        runner = self.runner
        if runner.loop is not None and not runner.finished.is_set():
            runner.stop_requested = True
            self.outbox.closed = True
            runner.wake_up()
            if not runner.finished.wait(CLOSE_TIMEOUT_S + 5):
                log.warning("events: the MQTT thread did not stop within %.0fs", CLOSE_TIMEOUT_S + 5)
        runner.join(timeout=1)

    def _events_off(self) -> None:
        self.disabled = self.outbox.closed = True

    # -- the thread ---------------------------------------------------------------------------------------
    async def _main(self) -> None:
        broker = None
        if self.address is None:
            broker = await self._start_embedded()
            if broker is None:
                self.disabled = self.outbox.closed = True
                self.outbox.drop_all()
                self.runner.ready.set()
                return
        self.runner.ready.set()
        try:
            await self._publish_forever()
        finally:
            if broker is not None:
                try:
                    await broker.close()
                except Exception:  # shutting down anyway; the error is logged
                    log.exception("events: the embedded MQTT broker did not shut down cleanly")

    async def _start_embedded(self) -> EmbeddedBroker | None:
        """The embedded broker, listening, with `address` and the reader settings set; None (logged, with
        the fix) where it cannot start."""
        try:
            require("amqtt", "broker", "the embedded MQTT broker (events.broker: embedded, the default)")
        except MissingExtraError as error:
            self.broker_error = f"{error}; or set events.broker to an external broker's URL. Job events are off"
            log.warning("events: %s", self.broker_error)
            return None
        from orchestrator.mqtt.broker import EmbeddedBroker, embedded_broker_config, write_password_file

        logging.getLogger("amqtt").setLevel(logging.WARNING)
        logging.getLogger("transitions").setLevel(logging.WARNING)   # amqtt's state machines, chatty at INFO
        port = self.config.embedded_port
        assert self.state_dir is not None
        broker = EmbeddedBroker()
        try:
            await broker.bind(port)
        except OSError as error:
            self._embedded_failed(port, error)
            return None
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            credentials = broker_credentials(self.state_dir)
            password_file = write_password_file(self.state_dir, credentials)
        except (OSError, ValueError) as error:
            log.warning("events: cannot set up the embedded MQTT broker's accounts in %s (%s); job events are off. "
                        "The service's user must be able to write its state dir", self.state_dir, error)
            await broker.close()
            return None
        try:
            await broker.start(embedded_broker_config(password_file, credentials, self.topics.prefix,
                                                      self.state_dir / USERS_FILE))
        except Exception as error:  # noqa: BLE001 - the service runs on without events; the fix is logged
            await broker.close()
            self._embedded_failed(port, error.__cause__ or error)
            return None
        self.address = BrokerAddress("127.0.0.1", broker.port, username=credentials.service.username,
                                     password=credentials.service.password)
        self.outbox.where = self.address.url
        try:
            self.reader_file = write_reader_settings(self.state_dir, self.address, self.topics.prefix,
                                                     credentials.reader)
        except OSError as error:
            log.warning("events: cannot write the MQTT reader settings to %s (%s); subscribers must take the reader "
                        "account from %s", self.state_dir / READER_FILE, error, self.state_dir / CREDENTIALS_FILE)
        log.info("events: embedded MQTT broker on %s (accounts in %s)", self.address.url, self.state_dir)
        return broker

    @staticmethod
    def _embedded_failed(port: int, cause: BaseException) -> None:
        log.warning("events: cannot start the embedded MQTT broker on 127.0.0.1:%d (%s); job events are off. "
                    "Set events.embedded_port to a free port (0 = any free port) or events.broker to an "
                    "external broker's URL (mqtt://host:1883), or events.enabled: false", port, cause)

    # -- publishing ---------------------------------------------------------------------------------------
    def _tls_context(self) -> ssl.SSLContext | None:
        if self.address is None:
            return None
        return tls_context(self.address.tls, self.config.ca_file, "events.ca_file")

    async def _publish_forever(self) -> None:
        import aiomqtt

        from orchestrator.mqtt.handshake import HandshakeClient

        assert self.address is not None
        address = self.address
        # unguessable: amqtt lets a connection that claims a client id end that id's session before it checks
        # the credentials, so a guessable id would let anyone on the host knock the publisher off
        identifier = f"aspen-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"
        backoff = BACKOFF_MIN_S
        while True:
            will = aiomqtt.Will(self.topics.status_topic, self.topics.last_will(), 1, True)
            try:
                async with HandshakeClient(address.host, address.port, username=address.username,
                                          password=address.password, identifier=identifier, will=will,
                                          tls_context=self._tls_context(), timeout=10,
                                          logger=client_logger(PUBLISHER_LOG)) as client:
                    self.connected, self.outbox.down, backoff = True, False, BACKOFF_MIN_S
                    log.info("events: connected to %s", address.url)
                    self._say_what_waited()
                    watcher = asyncio.create_task(self._watch_connection(client))
                    try:
                        await self._publish_at_connect(client)
                        await self._publish_outbox(client, watcher)
                        return      # stopped
                    finally:
                        watcher.cancel()
            except (aiomqtt.MqttError, OSError) as error:
                self.connected = False
                if self.runner.stop_requested:
                    log.warning("events: could not publish the offline status to %s: %s; %d event(s) left "
                                "unpublished", address.url, error, len(self.outbox))
                    return
                self._went_away(error)
                await self.runner.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                if self.runner.stop_requested:
                    if len(self.outbox):
                        log.warning("events: stopping while the MQTT broker %s is away: %d event(s) that waited "
                                    "are not published", address.url, len(self.outbox))
                    return

    async def _publish_at_connect(self, client: Any) -> None:
        """The retained `online` status, the clearings dropped, and the last state of every job with none
        waiting in the outbox (a broker restarted without persistence lost it; one that kept it sends its
        subscribers a repeat, which they tell by its `seq`): a job's waiting state goes out in turn."""
        await client.publish(self.topics.status_topic, self.topics.status("online"), qos=1, retain=True)
        states = self.topics.retained_states()    # first: a state queued after this is in queued_states
        waiting = self.outbox.queued_states()
        resent = [m for job_id in self.outbox.pending_clears() for m in self.topics.clearing(job_id)]
        for message in resent + [m for m in states if m.state_of not in waiting]:
            await client.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
            self.outbox.published(message)

    async def _publish_outbox(self, client: Any, watcher: asyncio.Task) -> None:
        """Publish the outbox in order, each message taken off once the broker acknowledged it (one whose
        publishing the connection's end cut short goes back first), until a stop is requested: then the
        retained `offline` status."""
        while True:
            message = self.outbox.take()
            if message is not None:
                try:
                    await client.publish(message.topic, message.payload, qos=message.qos, retain=message.retain,
                                         timeout=10)
                except BaseException:
                    self.outbox.give_back(message)
                    raise
                self.published += 1
                self.outbox.published(message)
                continue
            if self.runner.stop_requested:
                await client.publish(self.topics.status_topic, self.topics.status("offline", reason="shutdown"),
                                     qos=1, retain=True, timeout=CLOSE_TIMEOUT_S)
                return
            await self._idle(watcher)

    def _went_away(self, error: BaseException) -> None:
        if self.outbox.down:
            log.debug("events: still cannot reach %s: %s", self.outbox.where, error)
            return
        self.outbox.down = True
        self.away = (time.monotonic(), self.outbox.dropped_total)   # what was dropped before it went
        log.warning("events: MQTT broker %s unreachable (%s); its events wait in the service's queue (%d now, "
                    "%d at most: beyond that the oldest progress and events are dropped) to be published in "
                    "order when it is back; retrying with backoff (check events.broker)",
                    self.outbox.where, error, len(self.outbox), self.outbox.size)

    def _say_what_waited(self) -> None:
        """Back after the broker was away: how long, how many messages waited and how many were dropped
        meanwhile (the warnings while it was away come at most every WARN_EVERY_S and leave the last ones
        out)."""
        if self.away is None:
            return
        since, dropped_before = self.away
        self.away = None
        dropped = self.outbox.dropped_total - dropped_before
        log.warning("events: reconnected to %s after %.0f s away; publishing the %d event(s) that waited, in "
                    "order; %d event(s) were dropped meanwhile%s", self.outbox.where, time.monotonic() - since,
                    len(self.outbox), dropped,
                    " (the queue was full: the oldest progress and events first)" if dropped else "")

    async def _idle(self, watcher: asyncio.Task) -> None:
        """Wait for a message to publish, a stop request, or the connection to drop (raises MqttError)."""
        wake = self.runner.wake
        assert wake is not None
        wake.clear()
        if len(self.outbox) or self.runner.stop_requested:
            return
        waiter = asyncio.create_task(wake.wait())
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            waiter.cancel()
            watcher.result()

    @staticmethod
    async def _watch_connection(client: Any) -> None:
        """Ends (with aiomqtt's MqttError) when the connection drops, so that an idle publisher notices at
        once rather than at its next publish. Nothing is subscribed: no messages arrive."""
        import aiomqtt

        async for _ in client.messages:
            pass
        raise aiomqtt.MqttError("the connection to the broker closed")
