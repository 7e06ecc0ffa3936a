"""What the service publishes on MQTT: the message (topic, payload, QoS, retain) for each of the scheduler's
events, and which jobs' retained states the broker should hold and when each is cleared. No connection, no
thread, no broker here: `MqttListener` (`orchestrator.mqtt.listener`) hands these messages to the connection
(`orchestrator.mqtt.connection`).

Topics (under `events.topic_prefix`, default `aspen/v1`):
    jobs/<job>/state     every state change, retained, QoS 1
    jobs/<job>/progress  every optimizer step, QoS 1
    jobs/<job>/events    early stop, preemption, move, stop-rule predictions, evaluations, failures, QoS 1
    service/status       `online` (retained, at connect), `offline` (retained: last will, and on close)

Every JSON payload carries `publisher` (a random id, new at each start of the service) and `seq` (growing
in the order the service made its messages; a message sent to two topics, a user's job below, has one;
the last will made at each connection attempt takes one too, published or not): a subscriber tells a
message that comes again (QoS 1 may deliver one again after a reconnect, and every job's last state is
published again at each connect) by its (topic, publisher, seq); `aspen watch --events` leaves such
repeats out.

A job submitted by a user (a shared service: `aspen user add`) is published a second time under that user's
own topics, `users/<user>/jobs/<job>/state|progress|events`: the embedded broker lets each user's account
(their name, their API token as the password) read there and nowhere else (`orchestrator/mqtt/broker.py`),
while the service's reader account and admins read the whole prefix.

Retained job states are cleared (a zero-length retained publish on `jobs/<job>/state`, MQTT's way to
remove a retained message; subscribers then see an empty payload) when a job is deleted, and
`events.retain_finished_s` (default 7 days; null keeps them) after a job finished (completed,
stopped_early, failed, cancelled). A late subscriber thus gets the states of the current and recently
finished jobs. Finish times come from the job table, so jobs that finished longer ago than that before
the service started are cleared at its first round (an external broker may still hold their states)."""

from __future__ import annotations

import heapq
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from actors.service.table.job_table import JobRecord
from actors.service.trainer.trainer_reports import TrainerEvent
from orchestrator import strict_json

TOPIC_LEVEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def topic_level(name: str) -> str:
    """One topic level from a job id or name: anything but letters, digits, '.', '_' and '-' (so also
    MQTT's wildcards '+' and '#' and the separator '/') becomes '_'."""
    return TOPIC_LEVEL_UNSAFE.sub("_", name) or "_"


def topic_prefix(configured: str) -> str:
    """`events.topic_prefix` without its outer slashes; ValueError naming the field where it is empty or
    holds a wildcard."""
    prefix = configured.strip("/")
    if not prefix or "+" in prefix or "#" in prefix:
        raise ValueError(f"events.topic_prefix: '{configured}' must be a non-empty topic without the "
                         "wildcards '+' and '#' (default aspen/v1)")
    return prefix


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    state_of: str | None = None   # the job whose retained state this message sets (or, empty, clears)

    @property
    def clears(self) -> str | None:
        """The job whose retained state this (empty, retained) message clears, or None."""
        return self.state_of if self.state_of is not None and not self.payload else None


def _json(data: dict[str, Any]) -> bytes:
    return strict_json.dumps(data, default=str).encode()   # NaN: null, as the HTTP event stream sends it


class EventTopics:
    """The messages for the service's events under one topic prefix, and the retained states' bookkeeping:
    each job's last state (published again at every connect) and when a finished job's state is cleared.
    Called from the scheduler's thread and, for `retained_states`, the connection's."""

    def __init__(self, prefix: str, *, retain_finished_s: float | None, service_info: dict[str, Any] | None = None):
        self.prefix = prefix
        self.retain_finished_s = retain_finished_s
        self.service_info = dict(service_info or {})
        self.lock = threading.Lock()
        self.states: dict[str, bytes] = {}         # job id -> its last state payload
        self.clear_due: dict[str, float] = {}      # finished job id -> when its retained state is cleared
        self.clear_queue: list[tuple[float, str]] = []   # heap of (due, job id); entries not in clear_due are stale
        self.owners: dict[str, str] = {}           # job id -> the user who submitted it (jobs with a user only)
        self.publisher = secrets.token_hex(6)      # this start of the service, in every payload with `seq`
        self.seq = 0                               # the last `seq` given

    # -- topics and payloads ------------------------------------------------------------------------------
    @property
    def status_topic(self) -> str:
        return f"{self.prefix}/service/status"

    def job_topic(self, job_id: str, kind: str) -> str:
        return f"{self.prefix}/jobs/{topic_level(job_id)}/{kind}"

    def user_prefix(self, user: str) -> str:
        """The topics a user's account may read: their own jobs'."""
        return f"{self.prefix}/users/{topic_level(user)}"

    def job_topics(self, job_id: str, kind: str) -> list[str]:
        """Where a job's messages go: the service-wide topic, and its user's own where it has one."""
        with self.lock:
            user = self.owners.get(job_id)
        topic = self.job_topic(job_id, kind)
        return [topic] if user is None else [topic, f"{self.user_prefix(user)}/jobs/{topic_level(job_id)}/{kind}"]

    def _messages(self, job_id: str, kind: str, payload: bytes, qos: int, retain: bool,
                  state_of: str | None = None) -> list[Message]:
        return [Message(topic, payload, qos, retain, state_of=state_of) for topic in self.job_topics(job_id, kind)]

    def _numbered(self, data: dict[str, Any]) -> bytes:
        """The payload with this service's `publisher` and the next `seq`."""
        with self.lock:
            self.seq += 1
            seq = self.seq
        return _json({**data, "publisher": self.publisher, "seq": seq})

    def status(self, state: str, **extra: Any) -> bytes:
        """The service's status payload: `online` or `offline` (with a reason), and the service's facts."""
        return self._numbered({"state": state, "time": time.time(), **self.service_info, **extra})

    def last_will(self) -> bytes:
        """The `offline` status the broker publishes where the service's connection is lost (one for each
        connection, numbered then: a subscriber tells a second loss from a repeat of the first)."""
        return self.status("offline", reason="connection lost")

    def _event(self, job_id: str, kind: str, **data: Any) -> list[Message]:
        payload = {"job": job_id, "kind": kind, **data, "time": time.time()}
        return self._messages(job_id, "events", self._numbered(payload), 1, False)

    # -- the scheduler's events ---------------------------------------------------------------------------
    def job_changed(self, record: JobRecord, previous: str | None) -> list[Message]:
        """The job's new state (retained), and an event where it stopped early or failed."""
        payload = self._numbered({"job": record.id, "name": record.name, "state": record.state, "previous": previous,
                                  "reason": record.reason, "step": record.step, "total_steps": record.total_steps,
                                  "loss": record.loss, "eval_loss": record.eval_loss, "eval_score": record.eval_score,
                                  "trainer": record.trainer, "output_dir": record.output_dir, "time": time.time()})
        with self.lock:
            self.states[record.id] = payload
            if record.user is not None:
                self.owners[record.id] = record.user
        messages = self._messages(record.id, "state", payload, 1, True, state_of=record.id)
        self._track(record)
        if record.state in ("stopped_early", "failed"):
            messages += self._event(record.id, record.state, step=record.step, reason=record.reason)
        return messages

    def job_deleted(self, job_id: str) -> list[Message]:
        """The job is gone: its retained state is cleared."""
        return self._clear(job_id)

    def trainer_polled(self, events: list[TrainerEvent]) -> list[Message]:
        """Each optimizer step's progress; stop-rule predictions and evaluations as events."""
        messages = []
        for event in events:
            data = event.data
            if event.kind == "progress":
                payload = {"job": event.job_id, "step": event.step, "loss": data.get("loss"),
                           "tokens_per_s": data.get("tokens_per_s"), "tokens": data.get("tokens"),
                           "total_steps": data.get("total_steps"), "lr": data.get("lr"), "time": event.time}
                messages += self._messages(event.job_id, "progress", self._numbered(payload), 1, False)
            elif event.kind == "prediction":
                messages += self._event(event.job_id, "prediction", step=event.step,
                                        predicted_stop_step=data.get("predicted_stop_step"))
            elif event.kind == "eval":
                score = {"eval_score": data["eval_score"]} if data.get("eval_score") is not None else {}
                messages += self._event(event.job_id, "eval", step=event.step, eval_loss=data.get("eval_loss"), **score)
        return messages

    def decided(self, kind: str, job_id: str, reason: str) -> list[Message]:
        """Preemptions and moves as events (the waits of queued jobs are not published)."""
        if kind == "preempt":
            return self._event(job_id, "preempted", reason=reason)
        if kind == "move":
            return self._event(job_id, "moved", reason=reason)
        return []

    def tick(self, jobs: list[JobRecord], *, clear_unknown: bool, now: float | None = None) -> list[Message]:
        """Jobs not published yet (from before the service started) get their state published once, so that
        a fresh broker holds every job's retained state; of those, jobs that finished longer than
        `retain_finished_s` ago get theirs cleared instead where `clear_unknown` (a broker that may hold them
        from an earlier run; an embedded one starts empty). Then the finished jobs whose retention ran out
        are cleared (each once)."""
        now = time.time() if now is None else now
        messages = []
        for record in jobs:
            with self.lock:
                if record.id in self.states:
                    continue
            due = self._clear_time(record)
            if due is None or due > now:
                messages += self.job_changed(record, None)
            elif clear_unknown:
                with self.lock:
                    if record.user is not None:
                        self.owners[record.id] = record.user
                messages += self._clear(record.id)
        while True:
            with self.lock:
                if not self.clear_queue or self.clear_queue[0][0] > now:
                    break
                due, job_id = heapq.heappop(self.clear_queue)
                if self.clear_due.get(job_id) != due:
                    continue     # published again, or cleared already, since it was queued
            messages += self._clear(job_id)
        return messages

    def retained_states(self) -> list[Message]:
        """At each (re)connect: every job's last state again (a state change may have been dropped while
        the broker was away, and an embedded broker starts empty)."""
        with self.lock:
            states = list(self.states.items())
        return [message for job_id, payload in states for message in self._messages(job_id, "state", payload, 1, True,
                                                                                      state_of=job_id)]

    def clearing(self, job_id: str) -> list[Message]:
        """The messages that clear the job's retained state (sent again at a connect when one was dropped)."""
        return self._messages(job_id, "state", b"", 1, True, state_of=job_id)

    # -- retention ----------------------------------------------------------------------------------------
    def _clear_time(self, record: JobRecord) -> float | None:
        """When a job's retained state is due to be cleared: None while it runs, or when finished states
        are kept."""
        if not record.finished or self.retain_finished_s is None:
            return None
        return (record.finished_at or record.updated_at) + self.retain_finished_s

    def _track(self, record: JobRecord) -> None:
        due = self._clear_time(record)
        with self.lock:
            if due is None:
                self.clear_due.pop(record.id, None)
            elif self.clear_due.get(record.id) != due:
                self.clear_due[record.id] = due
                heapq.heappush(self.clear_queue, (due, record.id))

    def _clear(self, job_id: str) -> list[Message]:
        """Clear the job's retained state and forget it: it is not published again at reconnects."""
        messages = self.clearing(job_id)
        with self.lock:
            self.states.pop(job_id, None)
            self.clear_due.pop(job_id, None)
            self.owners.pop(job_id, None)
        return messages
