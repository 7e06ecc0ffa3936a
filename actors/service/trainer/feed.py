"""Streaming a job's micro-batches to its trainer with prefetch.

The job's data lives with its job actor; the trainer holds a `MicroBatchFeed`, which behaves like the
in-process `DataCursor` (next_batch / state_dict / load_state_dict / exhausted) but asks the job's data
for micro-batches ahead of time, so a fused step never waits for data. Requests are by position (the
cursor state before a micro-batch), so they are idempotent: after a restart, a feed restored to a
checkpoint's position asks for exactly the micro-batches the uninterrupted job would have seen."""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from actors.data import Example

T = TypeVar("T", covariant=True)


class JobLinkLost(RuntimeError):
    """The other end of a job's link is gone (its job actor died): the job's state on the trainer is intact,
    so the trainer checkpoints it and gives it back to be started again with a new job actor."""


class Pending(Protocol, Generic[T]):
    """A result on its way: a `concurrent.futures.Future`, or a Ray object ref behind a small adapter.
    `result()` raises `JobLinkLost` when the other end died."""

    def done(self) -> bool: ...

    def result(self) -> T: ...


def wait_for(pending: Pending[Any], timeout: float) -> bool:
    """Whether `pending` is done within `timeout` seconds (its own `wait` where it has one)."""
    if timeout <= 0 or pending.done():
        return pending.done()
    wait = getattr(pending, "wait", None)
    if wait is not None:
        return bool(wait(timeout))
    if isinstance(pending, concurrent.futures.Future):
        return bool(concurrent.futures.wait([pending], timeout).done)
    deadline = time.monotonic() + timeout
    while not pending.done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


@dataclass
class FeedChunk:
    """Consecutive micro-batches from `positions[0]` on; `end` is the position after the last one."""

    batches: list[list[Example]]
    positions: list[dict[str, Any]]
    end: dict[str, Any]
    exhausted: bool   # nothing comes after `end`


@dataclass
class Done(Generic[T]):
    """An already available result (for in-process links)."""

    value: T

    def done(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True

    def result(self) -> T:
        return self.value


Fetch = Callable[[dict[str, Any], int], Pending[FeedChunk]]


class MicroBatchFeed:
    def __init__(self, fetch: Fetch, start: dict[str, Any], *, prefetch: int = 4):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.fetch = fetch
        self.prefetch = prefetch
        self.position = dict(start)                 # before the next micro-batch not yet handed out
        self.buffer: deque[tuple[dict[str, Any], list[Example]]] = deque()
        self.request_from = dict(start)             # where the next request starts
        self.in_flight: Pending[FeedChunk] | None = None
        self.end_known = False                      # the data ends at `request_from`
        self.waits = 0                              # times next_batch had to block on data

    @property
    def exhausted(self) -> bool:
        return self.end_known and not self.buffer and self.in_flight is None

    def prime(self) -> None:
        """Start fetching now (a newly assigned job's data is on its way before its first step)."""
        self._pump()

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether `next_batch` will answer without blocking (a micro-batch is here, or the answer to the
        request in flight is, or the data has ended), waiting up to `timeout` seconds for it."""
        self._pump()
        if self.buffer or self.in_flight is None:
            return True
        return wait_for(self.in_flight, timeout)

    def _absorb(self, chunk: FeedChunk) -> None:
        self.buffer.extend(zip(chunk.positions, chunk.batches, strict=True))
        self.request_from = dict(chunk.end)
        self.end_known = chunk.exhausted or not chunk.batches

    def _pump(self) -> None:
        if self.in_flight is not None and self.in_flight.done():
            chunk, self.in_flight = self.in_flight.result(), None
            self._absorb(chunk)
        if self.in_flight is None and not self.end_known and len(self.buffer) < self.prefetch:
            self.in_flight = self.fetch(dict(self.request_from), self.prefetch - len(self.buffer) + self.prefetch // 2)

    def next_batch(self) -> list[Example] | None:
        self._pump()
        while not self.buffer and self.in_flight is not None:
            self.waits += 1
            chunk, self.in_flight = self.in_flight.result(), None
            self._absorb(chunk)
            self._pump()
        if not self.buffer:
            return None
        _, batch = self.buffer.popleft()
        self.position = dict(self.buffer[0][0]) if self.buffer else dict(self.request_from)
        self._pump()
        return batch

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position: what was buffered or requested is dropped."""
        self.position = dict(state)
        self.request_from = dict(state)
        self.buffer.clear()
        self.in_flight = None
        self.end_known = False
