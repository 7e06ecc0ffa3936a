"""Job events over MQTT: `MqttListener` hears the scheduler (a `ServiceListener`) and publishes each job's
state changes, progress and notable events, plus the service's own online/offline status, to an MQTT
broker: an embedded amqtt broker started with the service (default), or an external one.

The scheduler's calls only put a message on a bounded queue; a daemon thread runs its own asyncio loop
(the embedded broker, and an aiomqtt client that publishes the queue and reconnects with backoff). When
the broker is unreachable or the queue is full, events are dropped with a (rate-limited) warning and
training goes on.

Topics (under `events.topic_prefix`, default `aspen/v1`):
    jobs/<job>/state     every state change, retained, QoS 1
    jobs/<job>/progress  every optimizer step, QoS 0
    jobs/<job>/events    early stop, preemption, move, stop-rule predictions, evaluations, failures, QoS 1
    service/status       `online` (retained, at connect), `offline` (retained: last will, and on close)

Retained job states are cleared (a zero-length retained publish on `jobs/<job>/state`, MQTT's way to
remove a retained message; subscribers then see an empty payload) when a job is deleted, and
`events.retain_finished_s` (default 7 days; null keeps them) after a job finished (completed,
stopped_early, failed, cancelled). A late subscriber thus gets the states of the current and recently
finished jobs. Finish times come from the job table, so jobs that finished longer ago than that before
the service started are cleared at its first round (an external broker may still hold their states);
a clearing dropped while the broker was away is sent again at the next connect.

The embedded broker admits only the accounts the service generates (random passwords, kept in the
service's state dir, all files mode 0600, reused across restarts):
    mqtt-credentials.json  {"version": 1, "service": {"username", "password"}, "reader": {...}}: the
                           service's publisher account and the subscribers' read-only account
    mqtt-passwords         `username:<argon2 hash>` lines, amqtt's FileAuthPlugin reads them
    mqtt-reader.json       {"url", "topic_prefix", "username", "password"}: what a subscriber needs (the
                           reader account and the running broker's address; see `reader_settings`),
                           written when the broker starts. It holds no publisher secret, so it is the
                           file to share (e.g. `chmod g+r`) with people who may watch the jobs.
Anonymous connections are refused; only the service account may publish (under the topic prefix), the
reader and the service may subscribe to the prefix (amqtt's TopicAccessControlListPlugin). A publish
that the ACL refuses is acknowledged by the broker but dropped: nobody receives it, nothing is retained.
External brokers (`events.broker: mqtt://...`) use `events.username`/`events.password` as configured.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import os
import re
import secrets
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.engine.extras import MissingExtraError, require
from actors.service.config import EventsConfig
from actors.service.job_table import JobRecord
from actors.service.trainer_reports import TrainerEvent, TrainerStatus
from orchestrator.mqtt_settings import (
    CREDENTIALS_FILE,
    READER_FILE,
    BrokerAddress,
    broker_credentials,
    parse_broker_url,
    write_reader_settings,
)

log = logging.getLogger(__name__)

TOPIC_LEVEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
QUEUE_SIZE = 10_000
WARN_EVERY_S = 30.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0
CLOSE_TIMEOUT_S = 5.0



def topic_level(name: str) -> str:
    """One topic level from a job id or name: anything but letters, digits, '.', '_' and '-' (so also
    MQTT's wildcards '+' and '#' and the separator '/') becomes '_'."""
    return TOPIC_LEVEL_UNSAFE.sub("_", name) or "_"


def port_taken(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be listened on (binding as the broker will, with SO_REUSEADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as error:
            return error
    return None


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    clears: str | None = None    # the job whose retained state this (empty, retained) message clears


class MqttListener:
    """Publishes the service's job events to MQTT (see the module docstring for topics and payloads)."""

    def __init__(self, config: EventsConfig, *, state_dir: str | Path | None = None,
                 service_info: dict[str, Any] | None = None, queue_size: int = QUEUE_SIZE,
                 start_timeout: float = 10.0):
        """`state_dir`: the service's state folder, where the embedded broker keeps its accounts (required
        with `broker: embedded`, unused with an external broker)."""
        prefix = config.topic_prefix.strip("/")
        if not prefix or "+" in prefix or "#" in prefix:
            raise ValueError(f"events.topic_prefix: '{config.topic_prefix}' must be a non-empty topic without the "
                             "wildcards '+' and '#' (default aspen/v1)")
        self.config = config
        self.prefix = prefix
        self.service_info = dict(service_info or {})
        self.embedded = config.broker == "embedded"
        self.address: BrokerAddress | None = None
        self.state_dir = Path(state_dir).expanduser() if state_dir is not None else None
        self.reader_file: Path | None = None     # written once the embedded broker listens
        if self.embedded and self.state_dir is None:
            raise ValueError("events.broker 'embedded': the broker keeps its accounts in the service's state dir; "
                             "pass state_dir to MqttListener (service_listeners does)")
        if not self.embedded:
            self.address = parse_broker_url(config.broker, config.username, config.password)
            if config.ca_file is not None and not config.ca_file.is_file():
                raise ValueError(f"events.ca_file: {config.ca_file} does not exist")
        self.queue: deque[Message] = deque()
        self.queue_size = queue_size
        self.queue_lock = threading.Lock()
        self.published_states: dict[str, bytes] = {}   # job id -> its last state payload (republished on reconnect)
        self.retain_finished_s = config.retain_finished_s
        self.tracking_lock = threading.Lock()
        self.clear_due: dict[str, float] = {}          # finished job id -> when its retained state is cleared
        self.clear_queue: list[tuple[float, str]] = []   # heap of (due, job id); entries not in clear_due are stale
        self.unsent_clears: set[str] = set()   # job ids whose clearing is not published yet: sent again at connects
        self.connected = False
        self.down = False            # a connection attempt failed and none succeeded since: drop, don't queue
        self.disabled = False        # the embedded broker could not start: no events at all
        self.broker_error: str | None = None   # why not, where the user can act on it (a missing extra)
        self.dropped = 0
        self.last_warning = 0.0
        self.published = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake: asyncio.Event | None = None
        self.stop_requested = False
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._thread_main, name="mqtt-events", daemon=True)
        self.thread.start()
        if not self.ready.wait(start_timeout):
            log.warning("events: the MQTT thread did not start within %.0fs; events are queued until it does",
                        start_timeout)

    # -- topics and payloads ------------------------------------------------------------------------------
    @property
    def status_topic(self) -> str:
        return f"{self.prefix}/service/status"

    def job_topic(self, job_id: str, kind: str) -> str:
        return f"{self.prefix}/jobs/{topic_level(job_id)}/{kind}"

    @staticmethod
    def _json(data: dict[str, Any]) -> bytes:
        return json.dumps(data, default=str).encode()

    def _state_payload(self, record: JobRecord, previous: str | None) -> bytes:
        return self._json({"job": record.id, "name": record.name, "state": record.state, "previous": previous,
                           "reason": record.reason, "step": record.step, "total_steps": record.total_steps,
                           "loss": record.loss, "eval_loss": record.eval_loss, "trainer": record.trainer,
                           "output_dir": record.output_dir, "time": time.time()})

    def _status_payload(self, state: str, **extra: Any) -> bytes:
        return self._json({"state": state, "time": time.time(), **self.service_info, **extra})

    # -- ServiceListener ----------------------------------------------------------------------------------
    def job_changed(self, record: JobRecord, previous: str | None) -> None:
        payload = self._state_payload(record, previous)
        self.published_states[record.id] = payload
        with self.queue_lock:
            self.unsent_clears.discard(record.id)
        self._put(Message(self.job_topic(record.id, "state"), payload, 1, True))
        self._track(record)
        if record.state in ("stopped_early", "failed"):
            self._event(record.id, record.state, step=record.step, reason=record.reason)

    def job_deleted(self, job_id: str) -> None:
        """The job is gone: clear its retained state."""
        self._clear(job_id)

    def trainer_polled(self, status: TrainerStatus, events: list[TrainerEvent]) -> None:
        for event in events:
            data = event.data
            if event.kind == "progress":
                payload = {"job": event.job_id, "step": event.step, "loss": data.get("loss"),
                           "tokens_per_s": data.get("tokens_per_s"), "tokens": data.get("tokens"),
                           "total_steps": data.get("total_steps"), "lr": data.get("lr"), "time": event.time}
                self._put(Message(self.job_topic(event.job_id, "progress"), self._json(payload), 0, False))
            elif event.kind == "prediction":
                self._event(event.job_id, "prediction", step=event.step,
                            predicted_stop_step=data.get("predicted_stop_step"))
            elif event.kind == "eval":
                self._event(event.job_id, "eval", step=event.step, eval_loss=data.get("eval_loss"))

    def decided(self, kind: str, job_id: str, reason: str) -> None:
        if kind == "preempt":
            self._event(job_id, "preempted", reason=reason)
        elif kind == "move":
            self._event(job_id, "moved", reason=reason)

    def tick(self, jobs: list[JobRecord], counts: dict[str, int], trainers: list[TrainerStatus]) -> None:
        """Jobs this listener has not published yet (from before the service started) get their state
        published once, so that a fresh broker holds every job's retained state; of those, jobs that
        finished longer than `retain_finished_s` ago get theirs cleared instead. Then the finished jobs
        whose retention ran out are cleared (each once)."""
        now = time.time()
        for record in jobs:
            if record.id in self.published_states:
                continue
            due = self._clear_time(record)
            if due is None or due > now:
                self.job_changed(record, None)
            elif not self.embedded:   # the embedded broker starts empty: nothing of it to clear
                self._clear(record.id)
        while True:
            with self.tracking_lock:
                if not self.clear_queue or self.clear_queue[0][0] > now:
                    break
                due, job_id = heapq.heappop(self.clear_queue)
                if self.clear_due.get(job_id) != due:
                    continue     # published again, or cleared already, since it was queued
            self._clear(job_id)

    def describe(self) -> dict[str, str]:
        if self.disabled:
            return {"events_error": self.broker_error} if self.broker_error else {}
        if self.address is None:
            return {}
        described = {"mqtt_url": self.address.url, "mqtt_topics": f"{self.prefix}/#"}
        if self.reader_file is not None:
            described["mqtt_credentials"] = str(self.reader_file)
        return described

    def close(self) -> None:
        """Publish the retained `offline` status, disconnect, stop the embedded broker (waits a few
        seconds at most)."""
        if self.loop is not None and not self.finished.is_set():
            self.stop_requested = True
            self._wake_loop()
            if not self.finished.wait(CLOSE_TIMEOUT_S + 5):
                log.warning("events: the MQTT thread did not stop within %.0fs", CLOSE_TIMEOUT_S + 5)
        self.thread.join(timeout=1)

    # -- retention ----------------------------------------------------------------------------------------
    def _clear_time(self, record: JobRecord) -> float | None:
        """When a job's retained state is due to be cleared: None while it runs, or when finished states
        are kept."""
        if not record.finished or self.retain_finished_s is None:
            return None
        return (record.finished_at or record.updated_at) + self.retain_finished_s

    def _track(self, record: JobRecord) -> None:
        due = self._clear_time(record)
        with self.tracking_lock:
            if due is None:
                self.clear_due.pop(record.id, None)
            elif self.clear_due.get(record.id) != due:
                self.clear_due[record.id] = due
                heapq.heappush(self.clear_queue, (due, record.id))

    def _clear(self, job_id: str) -> None:
        """Clear the job's retained state on the broker (a zero-length retained publish) and forget it: it
        is not published again at reconnects. Until the broker has it, the clearing is sent again at each
        (re)connect (so one dropped while the broker was away is not lost)."""
        self.published_states.pop(job_id, None)
        with self.tracking_lock:
            self.clear_due.pop(job_id, None)
        self._put(Message(self.job_topic(job_id, "state"), b"", 1, True, clears=job_id))

    # -- the queue ----------------------------------------------------------------------------------------
    def _event(self, job_id: str, kind: str, **data: Any) -> None:
        payload = {"job": job_id, "kind": kind, **data, "time": time.time()}
        self._put(Message(self.job_topic(job_id, "events"), self._json(payload), 1, False))

    def _put(self, message: Message) -> None:
        if self.disabled or self.stop_requested:
            return
        with self.queue_lock:
            if message.clears is not None:   # until it is published (queued, or dropped right here)
                self.unsent_clears.add(message.clears)
            full = len(self.queue) >= self.queue_size
            if not full and not self.down:
                self.queue.append(message)
                accepted = True
            else:
                accepted = False
        if accepted:
            self._wake_loop()
        else:
            self._dropped("the queue is full" if full else "the broker is unreachable")

    def _dropped(self, why: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self.last_warning >= WARN_EVERY_S:
            where = self.address.url if self.address else "the embedded broker"
            log.warning("events: dropped %d MQTT event(s) since the last warning: %s (%s); training goes on, "
                        "reconnecting with backoff", self.dropped, why, where)
            self.last_warning = now
            self.dropped = 0

    def _wake_loop(self) -> None:
        loop, wake = self.loop, self.wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:   # the loop has closed (the service is stopping): nothing left to wake
                log.debug("events: the MQTT loop has closed")

    def _take(self) -> Message | None:
        with self.queue_lock:
            return self.queue.popleft() if self.queue else None

    # -- the background thread -----------------------------------------------------------------------------
    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # events must never stop the service; the error is logged
            log.exception("events: the MQTT thread failed; job events are off")
            self.disabled = True
        finally:
            self.ready.set()
            self.finished.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        broker = None
        if self.embedded:
            broker = await self._start_embedded()
            if broker is None:
                self.disabled = True
                with self.queue_lock:
                    self.queue.clear()
                self.ready.set()
                return
        self.ready.set()
        try:
            await self._publish_forever()
        finally:
            if broker is not None:
                try:
                    await broker.shutdown()
                except Exception:  # shutting down anyway; the error is logged
                    log.exception("events: the embedded MQTT broker did not shut down cleanly")

    async def _start_embedded(self) -> Any:
        try:
            require("amqtt", "broker", "the embedded MQTT broker (events.broker: embedded, the default)")
        except MissingExtraError as error:
            self.broker_error = f"{error}; or set events.broker to an external broker's URL. Job events are off"
            log.warning("events: %s", self.broker_error)
            return None
        from amqtt.broker import Broker

        from orchestrator.mqtt_broker import embedded_broker_config, write_password_file

        logging.getLogger("amqtt").setLevel(logging.WARNING)
        logging.getLogger("transitions").setLevel(logging.WARNING)   # amqtt's state machines, chatty at INFO
        port = self.config.embedded_port
        taken = port_taken("127.0.0.1", port) if port else None
        if taken is not None:
            self._embedded_failed(port, taken)
            return None
        assert self.state_dir is not None
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            credentials = broker_credentials(self.state_dir)
            password_file = write_password_file(self.state_dir, credentials)
        except (OSError, ValueError) as error:
            log.warning("events: cannot set up the embedded MQTT broker's accounts in %s (%s); job events are off. "
                        "The service's user must be able to write its state dir", self.state_dir, error)
            return None
        try:
            broker = Broker(embedded_broker_config(port, password_file, credentials, self.prefix))
            await broker.start()
        except Exception as error:  # noqa: BLE001 - the service runs on without events; the fix is logged
            self._embedded_failed(port, error.__cause__ or error)
            return None
        server = getattr(broker, "_servers", {}).get("default")
        sockets = getattr(getattr(server, "instance", None), "sockets", None)
        real_port = sockets[0].getsockname()[1] if sockets else port
        self.address = BrokerAddress("127.0.0.1", real_port, username=credentials.service.username,
                                     password=credentials.service.password)
        try:
            self.reader_file = write_reader_settings(self.state_dir, self.address, self.prefix, credentials.reader)
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

    def _tls_context(self) -> ssl.SSLContext | None:
        if self.address is None or not self.address.tls:
            return None
        cafile = str(self.config.ca_file) if self.config.ca_file else None
        return ssl.create_default_context(cafile=cafile)

    async def _publish_forever(self) -> None:
        import aiomqtt

        assert self.address is not None
        address = self.address
        # unguessable: amqtt lets a connection that claims a client id end that id's session before it checks
        # the credentials, so a guessable id would let anyone on the host knock the publisher off
        identifier = f"aspen-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"
        will = aiomqtt.Will(self.status_topic, self._status_payload("offline", reason="connection lost"), 1, True)
        backoff = BACKOFF_MIN_S
        pending: Message | None = None
        while True:
            try:
                async with aiomqtt.Client(address.host, address.port, username=address.username,
                                          password=address.password, identifier=identifier, will=will,
                                          tls_context=self._tls_context(), timeout=10) as client:
                    self.connected, self.down, backoff = True, False, BACKOFF_MIN_S
                    log.info("events: connected to %s", address.url)
                    watcher = asyncio.create_task(self._watch_connection(client))
                    try:
                        await client.publish(self.status_topic, self._status_payload("online"), qos=1, retain=True)
                        for job_id in self._unsent_clears():
                            await client.publish(self.job_topic(job_id, "state"), b"", qos=1, retain=True)
                            self._cleared(job_id)
                        for payload_topic, payload in self._republish():
                            await client.publish(payload_topic, payload, qos=1, retain=True)
                        while True:
                            if pending is None:
                                pending = self._take()
                            if pending is not None:
                                await client.publish(pending.topic, pending.payload, qos=pending.qos,
                                                     retain=pending.retain, timeout=10)
                                self.published += 1
                                if pending.clears is not None:
                                    self._cleared(pending.clears)
                                pending = None
                                continue
                            if self.stop_requested:
                                await client.publish(self.status_topic,
                                                     self._status_payload("offline", reason="shutdown"),
                                                     qos=1, retain=True, timeout=CLOSE_TIMEOUT_S)
                                return
                            await self._idle(watcher)
                    finally:
                        watcher.cancel()
            except (aiomqtt.MqttError, OSError) as error:
                self.connected = False
                if self.stop_requested:
                    log.warning("events: could not publish the offline status to %s: %s", address.url, error)
                    return
                if not self.down:
                    self.down = True
                    with self.queue_lock:
                        lost = len(self.queue)
                        self.queue.clear()
                    log.warning("events: MQTT broker %s unreachable (%s); %d queued event(s) dropped, events are "
                                "dropped until it is back, retrying with backoff (check events.broker)",
                                address.url, error, lost)
                else:
                    log.debug("events: still cannot reach %s: %s", address.url, error)
                pending = None
                await self._sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                if self.stop_requested:
                    return

    async def _idle(self, watcher: asyncio.Task) -> None:
        """Wait for a message to publish, a stop request, or the connection to drop (raises MqttError)."""
        assert self.wake is not None
        self.wake.clear()
        if self._take_peek() or self.stop_requested:
            return
        waiter = asyncio.create_task(self.wake.wait())
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

    def _take_peek(self) -> bool:
        with self.queue_lock:
            return bool(self.queue)

    def _unsent_clears(self) -> list[str]:
        """At each (re)connect: the clearings that were dropped (those still queued go out in turn)."""
        with self.queue_lock:
            queued = {message.clears for message in self.queue if message.clears is not None}
            return sorted(self.unsent_clears - queued)

    def _cleared(self, job_id: str) -> None:
        with self.queue_lock:
            self.unsent_clears.discard(job_id)

    def _republish(self) -> list[tuple[str, bytes]]:
        """At each (re)connect: every job's last state again (a state change may have been dropped while
        the broker was away, and an embedded broker starts empty)."""
        return [(self.job_topic(job_id, "state"), payload) for job_id, payload in list(self.published_states.items())]

    async def _sleep(self, seconds: float) -> None:
        assert self.wake is not None
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except TimeoutError:
            pass
