"""Choosing a kernel for a shape by measuring it on the device, without the host ever waiting: how the CUDA LoRA
path picks between torch's grouped GEMM and its own Triton kernels (actors/engine/rank_products.py,
weight_grad_products.py), where no model says which is faster on this card, at this size, with this many jobs.

A shape's first calls time the candidates in turn, each by a pair of CUDA events read only once the GPU has passed
them (`query` does not wait) and by the host's clock around the call (a candidate's first call is not timed:
Triton compiles then). Each candidate runs first in its call, so that it reads its inputs as the step leaves them
(not warmed in the cache by another candidate), and the call's result is always the default's (a candidate's is
computed beside it and dropped): measuring changes no number of a step, and a recomputed forward gets what its
forward got. The times are read, and the choice made, at a shape's first call in a new step (a step computes
every call of a shape one way): the least median GPU time plus median host time a call, so a kernel that saves the
GPU less than it costs the host loses (on the 8B step the host is about as busy as the GPU). A candidate that
raises a kernel error is left out, logged. The choice is a measurement: two runs may round differently (each
caller has a setting that forces one kernel)."""

from __future__ import annotations

import contextlib
import logging
import statistics
import weakref
from collections.abc import Callable, Iterable, Iterator
from time import perf_counter

import torch

from actors.engine.layout import current_layout
from actors.engine.triton_support import KERNEL_ERRORS

log = logging.getLogger(__name__)

SAMPLES = 5   # timed calls of each candidate before a shape's kernel is chosen


class Tuning:
    """One shape's candidates (the first is the default, whose results the step keeps while measuring), their event
    pairs not yet read, their GPU and host times (ms) and, once known, the choice."""

    def __init__(self, description: str, candidates: list[str]):
        self.description = description
        self.candidates = candidates
        self.calls = 0
        self.pending: list[tuple[str, object, object]] = []
        self.times: dict[str, list[float]] = {name: [] for name in candidates}
        self.host: dict[str, list[float]] = {name: [] for name in candidates}
        self.chosen: str | None = None if len(candidates) > 1 else candidates[0]
        self.layout: weakref.ref | None = None   # the step of the last read

    def drop(self, name: str) -> None:
        self.candidates.remove(name)
        del self.times[name], self.host[name]
        self.pending = [entry for entry in self.pending if entry[0] != name]
        if len(self.candidates) == 1:
            self.chosen = self.candidates[0]

    def read(self) -> None:
        """The times of the event pairs the GPU has passed; the choice once every candidate has its samples."""
        still = []
        for name, start, end in self.pending:
            if end.query():
                self.times[name].append(start.elapsed_time(end))
            else:
                still.append((name, start, end))
        self.pending = still
        if all(len(times) >= SAMPLES for times in self.times.values()):
            self.chosen = min(self.candidates, key=self.cost)
            log.info("%s takes %s on this device: median GPU + host ms a call %s", self.description, self.chosen,
                     {name: round(self.cost(name), 4) for name in self.candidates})

    def cost(self, name: str) -> float:
        """Median GPU ms plus median host ms a call."""
        return statistics.median(self.times[name]) + statistics.median(self.host[name])


TUNINGS: dict[tuple, Tuning] = {}
_WATCHED: list[set[Tuning] | None] = [None]   # `watched`: the shapes still measured by the calls inside


@contextlib.contextmanager
def watched() -> Iterator[set[Tuning]]:
    """The shapes whose kernel was still being measured in the calls made inside (on any thread: a backward's
    products run on autograd's), for `settled`."""
    seen: set[Tuning] = set()
    previous, _WATCHED[0] = _WATCHED[0], seen
    try:
        yield seen
    finally:
        _WATCHED[0] = previous


def measured(tuning: Tuning, run: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """A call of `tuning`'s shape: `run(name)` computes it with a candidate. Until the choice, the next candidate
    is timed and the default's result returned (module docstring); after it, the chosen one's."""
    if _WATCHED[0] is not None and tuning.chosen is None:
        _WATCHED[0].add(tuning)
    layout = current_layout()
    if tuning.chosen is None and (tuning.layout is None or tuning.layout() is not layout):
        tuning.layout = weakref.ref(layout) if layout is not None else None
        tuning.read()
    if tuning.chosen is not None:
        return run(tuning.chosen)
    default = tuning.candidates[0]
    name = tuning.candidates[tuning.calls % len(tuning.candidates)]
    timed = tuning.calls >= len(tuning.candidates)
    tuning.calls += 1
    if timed:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    launched = perf_counter()
    try:
        out = run(name)
    except KERNEL_ERRORS as error:   # a candidate that cannot compile or launch for this shape: left out
        if name == default:
            raise
        log.warning("%s: the kernel %s failed (%s: %s); the shape is left to the others", tuning.description, name,
                    type(error).__name__, error)
        tuning.drop(name)
        return run(default)
    if timed:
        tuning.host[name].append((perf_counter() - launched) * 1e3)
        end.record()
        tuning.pending.append((name, start, end))
    return out if name == default else run(default)


def decisions() -> dict[str, dict]:
    """Each measured shape's choice and median times (ms), by its description: for benchmark reports."""
    def median(times: list[float]) -> float | None:
        return round(statistics.median(times), 4) if times else None

    return {tuning.description: {"chosen": tuning.chosen,
                                 "median_ms": {name: median(times) for name, times in tuning.times.items()},
                                 "host_median_ms": {name: median(times) for name, times in tuning.host.items()}}
            for tuning in TUNINGS.values()}


def settled(tunings: Iterable[Tuning] | None = None) -> bool:
    """Whether each of `tunings` (a step's: `watched`; default: every shape measured so far) has its kernel chosen,
    the times the GPU has passed read first (a step captured as a CUDA graph must not time candidates:
    actors/engine/step_graphs.py warms a shape up until then). A step's own shapes, not every one: a shape only an
    earlier step had (the trainer's warm-up, the memory probe's steps, a job set that left) may never be called
    again, so never chosen."""
    for tuning in TUNINGS.values() if tunings is None else tunings:
        if tuning.chosen is None:
            tuning.read()
            if tuning.chosen is None:
                return False
    return True
