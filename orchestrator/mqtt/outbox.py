"""The bounded queue between the service's threads and the thread that publishes its MQTT messages
(`orchestrator.mqtt.connection`): `put` never blocks; while the broker is away the messages wait here, in
order, to be published when it is back; a full outbox drops its oldest message that is not a retained state
(progress first, as it comes most often), counted and said in a (rate-limited) warning."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from orchestrator.mqtt.topics import Message

log = logging.getLogger("orchestrator.mqtt.listener")   # the events' one logger, whichever module logs

QUEUE_SIZE = 10_000
WARN_EVERY_S = 30.0


class Outbox:
    """The messages not published yet, in the order they were made. `put` never blocks: a full outbox drops
    its oldest non-retained message (its oldest one where all are retained) to take the new one, with a
    warning every WARN_EVERY_S at most. It also remembers the clearings of retained states not published
    yet, to send them again at the next connect."""

    def __init__(self, size: int, where: str):
        self.size = size
        self.where = where            # the broker, as warnings name it
        self.lock = threading.Lock()
        self.queue: deque[Message] = deque()
        self.unsent_clears: set[str] = set()   # jobs whose clearing is not published yet
        self.down = False             # a connection attempt failed and none succeeded since: messages wait
        self.closed = False           # stopping, or events are off: take nothing more
        self.dropped = 0              # since the last warning
        self.dropped_total = 0        # since the start (`aspen serve`'s info shows it)
        self.last_warning = 0.0

    def __len__(self) -> int:
        with self.lock:
            return len(self.queue)

    def put(self, message: Message) -> bool:
        """Queue the message (dropping the oldest non-retained one where the outbox is full); False where the
        outbox is closed."""
        if message.state_of is not None and message.clears is None:
            with self.lock:
                self.unsent_clears.discard(message.state_of)   # a newer state supersedes a dropped clearing
        if self.closed:
            return False
        with self.lock:
            if message.clears is not None:   # until it is published (queued, or dropped later)
                self.unsent_clears.add(message.clears)
            full = len(self.queue) >= self.size
            if full:
                self._drop_oldest()
            self.queue.append(message)
        if full:
            self._dropped()
        return True

    def _drop_oldest(self) -> None:
        """Make room (the lock held): the oldest message that is not retained, else the oldest. A dropped
        clearing stays in `unsent_clears`, a dropped state is published again at the next connect."""
        for index, queued in enumerate(self.queue):
            if not queued.retain:
                del self.queue[index]
                return
        self.queue.popleft()

    def take(self) -> Message | None:
        with self.lock:
            return self.queue.popleft() if self.queue else None

    def give_back(self, message: Message) -> None:
        """A message taken whose publishing the broker's going cut short: first again at the next connect
        (the broker may have had it: subscribers tell the repeat by its `seq`)."""
        with self.lock:
            self.queue.appendleft(message)

    def drop_all(self) -> int:
        """Empty the outbox (events are off); how many messages were dropped."""
        with self.lock:
            lost = len(self.queue)
            self.queue.clear()
            self.dropped_total += lost
        return lost

    def pending_clears(self) -> list[str]:
        """At each (re)connect: the clearings that were dropped (those still queued go out in turn)."""
        with self.lock:
            queued = {message.clears for message in self.queue if message.clears is not None}
            return sorted(self.unsent_clears - queued)

    def queued_states(self) -> set[str]:
        """The jobs whose state (or clearing) is queued: their last state goes out in turn, not before."""
        with self.lock:
            return {message.state_of for message in self.queue if message.state_of is not None}

    def published(self, message: Message) -> None:
        if message.clears is not None:
            with self.lock:
                self.unsent_clears.discard(message.clears)

    def _dropped(self) -> None:
        self.dropped += 1
        self.dropped_total += 1
        now = time.monotonic()
        if now - self.last_warning >= WARN_EVERY_S:
            why = (f"it keeps the last {self.size} messages while the broker is away, reconnecting with backoff"
                   if self.down else "the broker takes the messages slower than the service makes them")
            log.warning("events: dropped %d MQTT event(s) since the last warning, the oldest progress and events "
                        "first: the queue is full (%s; %s); training goes on", self.dropped, self.where, why)
            self.last_warning = now
            self.dropped = 0
