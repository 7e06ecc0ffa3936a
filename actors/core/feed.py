"""Streaming a job's micro-batches to its trainer with prefetch.

The job's data lives with its job actor; the trainer holds a `MicroBatchFeed`, which behaves like the
in-process `DataCursor` (next_batch / state_dict / load_state_dict / exhausted) but asks the job's data
for micro-batches ahead of time, so a fused step never waits for data. Requests are by position (the
cursor state before a micro-batch), so they are idempotent: after a restart, a feed restored to a
checkpoint's position asks for exactly the micro-batches the uninterrupted job would have seen."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from actors.engine.data import Example

T = TypeVar("T", covariant=True)


class Pending(Protocol, Generic[T]):
    """A result on its way: a `concurrent.futures.Future`, or a Ray object ref behind a small adapter."""

    def done(self) -> bool: ...

    def result(self) -> T: ...


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

    def _absorb(self, chunk: FeedChunk) -> None:
        self.buffer.extend(zip(chunk.positions, chunk.batches))
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
