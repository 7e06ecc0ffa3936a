"""torch.profiler's memory records on a CPU, where torch keeps no allocator counter: a profile started and stopped
quietly (`start_memory_profile`, `stop_memory_profile`), a run or a window of several calls under one
(`with_memory_records`, `MemoryWindow`), and the peak of the allocations made inside it (`allocation_peak`)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._C._profiler import _ExtraFields_Allocation

log = logging.getLogger(__name__)
T = TypeVar("T")

# c10's log level while a memory profile is on (libc10's FLAGS_caffe2_log_level: 0 info, 1 warning, 2 error).
# torch's CPU allocator logs "Memory block of unknown size was allocated before the profiling started ..." when a
# block allocated before a profile started is freed inside it (its first time and every 1000th), to stderr, so in
# the user's terminal under `aspen run --in-process`: every measured window meets such frees, and the
# measurement expects them (`allocation_peak` counts only the blocks allocated inside the window).
C10_ERROR = 2
_SAVED_LEVEL: list[int] = []   # the level before the profile that is on now raised it


@functools.cache
def _c10_log_level() -> ctypes.c_int | None:
    """libc10's log level variable, or None where this torch's library is not found or does not export it (then
    nothing is quieted)."""
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_log_level")
    except (OSError, ValueError) as error:
        log.debug("c10's log level not found in %s (%s): the allocator's warnings stay on", library, error)
        return None


def _quiet_allocator_warnings() -> None:
    """Raise c10's log level to errors for the profile about to start, unless the user set TORCH_CPP_LOG_LEVEL
    (then their level holds) or it is at errors already."""
    level = _c10_log_level()
    if "TORCH_CPP_LOG_LEVEL" in os.environ or level is None or _SAVED_LEVEL or level.value >= C10_ERROR:
        return
    _SAVED_LEVEL.append(level.value)
    level.value = C10_ERROR


def stop_memory_profile() -> Any:
    """Turn the profile off: its records (`torch.autograd._disable_profiler()`'s result); c10's log level back."""
    from torch.autograd import _disable_profiler

    try:
        return _disable_profiler()
    finally:
        if _SAVED_LEVEL:
            _c10_log_level().value = _SAVED_LEVEL.pop()


# Kineto (torch's profiler library) prints two lines to stderr at each start and stop of a profile ("USDT:...
# SyncActivityProfilerHandler.cpp:52] profiler_start"), at its highest level, so that only the level above it
# (6: none) silences them; it reads KINETO_LOG_LEVEL when the process's first profile starts.
KINETO_SILENT = "6"


def start_memory_profile() -> None:
    """Turn torch's profiler on with memory records on and operation records off (only user scopes, which the
    engine does not open); `stop_memory_profile()` turns it off and returns the records.
    Kineto's per-start lines are kept out of the process's stderr (a run in the terminal printed two per
    measured step) unless KINETO_LOG_LEVEL is set already: a user who asks for kineto's log keeps it. In a
    trainer's process only the memory measurement here starts profiles."""
    from torch._C._profiler import RecordScope, _ExperimentalConfig
    from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
    _quiet_allocator_warnings()
    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    _prepare_profiler(config, {ProfilerActivity.CPU})
    _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})


def with_memory_records(run: Callable[[], T]) -> tuple[T, Any]:
    """Run `run()` under torch's profiler with memory records on and operation records off: (its result, the
    profiler's result, whose event tree holds one allocation record per CPU allocation and free).

    What `torch.autograd.profiler.profile(profile_memory=True)` does underneath (torch is pinned to 2.13),
    but with the operations' record scopes left out (only user scopes, which the engine does not open): a
    30-layer model's step has ~180,000 operation records beside ~50,000 memory records, and collecting
    and converting them cost 1-3 s a measured step, while the trainer stood idle."""
    start_memory_profile()
    try:
        result = run()
    finally:
        records = stop_memory_profile()
    return result, records


class MemoryWindow:
    """The allocator's peak over a window that spans several calls (a pipeline stage's share of a loop step):
    `start(live)` with the bytes live now, `stop()` the peak bytes live in between. CUDA: the allocator's
    peak counter; CPU: torch.profiler's memory records, as `with_memory_records` takes them.

    On CPU the profiler is on for the whole window, and work queued meanwhile on other threads (a pipeline
    stage's asynchronous sends, which gloo runs on its own threads with the queuing thread's state, the
    profiler's included) must have finished before `stop` turns it off: work still running then records into
    a profiler state already taken apart, which corrupted the process's memory and crashed it at exit (in
    the garbage collector). The stage waits for its sends first (`StageRuntime._measure`, `close`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.live = 0
        self.open = False

    def start(self, live: int) -> None:
        """Open a window; one left open (its step failed before `stop`) is closed first, unread."""
        if self.open:
            self.stop()
        self.live, self.open = live, True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        start_memory_profile()

    def close(self) -> None:
        """Close a window left open (a step that failed before `stop`), unread: on CPU the profiler it enabled is
        disabled here, in order, not left to the interpreter's exit."""
        if self.open:
            self.stop()

    def stop(self) -> int:
        if not self.open:
            raise RuntimeError("no memory window is open")
        self.open = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device))
        peak, _ = allocation_peak(stop_memory_profile())
        return self.live + peak


CPU_MEMORY_DEVICES = ("cpu", "mkldnn", "ideep")   # the device types of CPU allocations


def allocation_peak(result: Any) -> tuple[int, int]:
    """(the peak of the running sum of a profiler run's CPU allocations and frees in time order, the sum at the
    end), from `result`, what `_disable_profiler()` returned.

    Straight from the raw allocation records (one per allocation and free, with its address, bytes and time):
    not through the profiler's function events, which cost seconds to build for a step of tens of thousands of
    operations (14 s a step on a 30-layer model, every measured step: the trainer stood idle) and which place
    each record at the start of the operation it belongs to, so that a free in a parent operation counts before
    the allocations of its children and the peak comes out low (649 MB instead of 826 MB on a 30-layer
    model's step, where the loss's log-softmax is freed by the cross-entropy that called it).

    Only what was allocated inside the window counts when freed: torch's CPU allocator remembers the size of
    every block allocated while any profiler was on, so a block an *earlier* measured window allocated (an
    optimizer's state, a batch packed ahead, another trainer's garbage collected now) is reported, with its
    size, when it is freed inside this one. Counted, such frees pulled the running sum below the window's
    start and the peak came out low by their bytes (a memory probe after other measured steps in the same
    process: its prediction at least 16% under the step it priced)."""
    records = []
    nodes = list(reversed(result.experimental_event_tree()))   # popped in time order (ties too)
    while nodes:
        node = nodes.pop()
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            records.append((node.start_time_ns, fields.ptr, fields.alloc_size, fields.device))
        elif node.children:   # a user scope's
            nodes.extend(reversed(node.children))
    records.sort(key=lambda record: record[0])
    inside: dict[int, int] = {}   # address -> bytes, of the blocks allocated inside the window and live
    live = peak = 0
    for _, address, nbytes, device in records:
        if device.type not in CPU_MEMORY_DEVICES:
            continue
        if nbytes > 0:
            inside[address] = nbytes
            live += nbytes
            peak = max(peak, live)
        elif inside.pop(address, None) is not None:
            live += nbytes
    return peak, live
