"""Peak memory of one fused step.

Measured (`measure_peak`): the allocator's own count. On CUDA `torch.cuda.max_memory_allocated`; on CPU,
where torch keeps no allocator counter, the peak of live allocations recorded by torch.profiler's memory
events (every allocation and free of the step, in time order) over what was allocated before the step.
The trainer's memory model is fitted to these measurements.

Estimated (`StepMemoryMeter`, every step, cheap): on CUDA: `torch.cuda.max_memory_allocated` around the step. On CPU
there is no allocator counter, so we
count what a step really holds at its peak (the end of the forward pass): every tensor autograd saves
for backward (through saved-tensor hooks, each storage once, parameters excluded), plus the model's
weights and buffers, the adapters' gradients and optimizer state, plus the largest transient of the
loss (one chunk of logits). The scheduler fits its memory model to these numbers.

Resident (CPU): the process's resident set (`resident_bytes`), its peak (`peak_resident_bytes`, VmHWM) and
a run's peak over what was resident before (`measure_resident`). glibc's malloc is left as it is (its
dynamic mmap threshold: after a large free, blocks up to 32 MiB come from the heap, whose freed pages stay
resident and are reused by the next step); the resident set then runs above the live tensors by what the
heap retains, and `memory_prior` measures that on the probe steps, from a heap whose free pages were given
back first (`release_free_heap`), to predict it (`memory_prior.predict_resident`). Mapping every block above
64 KiB instead (a fixed mmap threshold) made the resident set follow the live tensors, but every large tensor
was then mapped, faulted in page by page and unmapped again, every step: 25-40% of a CPU step's time."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from torch._C._profiler import _ExtraFields_Allocation

log = logging.getLogger(__name__)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def model_bytes(model: nn.Module) -> int:
    """Weights and buffers, each storage once (tied weights counted once)."""
    seen: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        ptr, nbytes = _storage_key(tensor)
        seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


@dataclass
class SavedTensorCounter:
    """Counts the bytes autograd saves for backward, each storage once, known storages excluded."""

    exclude: set[int] = field(default_factory=set)
    storages: dict[int, int] = field(default_factory=dict)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            ptr, nbytes = _storage_key(tensor)
            if ptr not in self.exclude:
                self.storages[ptr] = max(self.storages.get(ptr, 0), nbytes)
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())


class StepMemoryMeter:
    """Use: `with meter.forward(): loss = ...` then `meter.peak_bytes(extra)` after backward."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.counter = SavedTensorCounter()
        self._weights: tuple[frozenset[int], int] | None = None   # (parameters' storages, bytes): `_counted`

    def refresh_weights(self) -> None:
        """The model's weights changed (an adapter added or removed): counted again where next needed (on a CPU, at
        the next step; on CUDA, where the allocator counts, never: a walk over every module and tensor of a base with
        many jobs' adapters takes a tenth of a second)."""
        self._weights = None

    def _counted(self) -> tuple[frozenset[int], int]:
        if self._weights is None:
            self._weights = (frozenset(_storage_key(p)[0] for p in self.model.parameters()), model_bytes(self.model))
        return self._weights

    @property
    def parameter_ptrs(self) -> frozenset[int]:
        return self._counted()[0]

    @property
    def weights(self) -> int:
        return self._counted()[1]

    @contextlib.contextmanager
    def forward(self) -> Iterator[SavedTensorCounter]:
        if self.device.type == "cuda":   # the allocator counts; no hooks (a Python call per saved tensor)
            self.counter = SavedTensorCounter()
            # the caching allocator keeps its counts on the host, in the order the host asks: no need to wait
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self.counter
            return
        self.counter = SavedTensorCounter(exclude=set(self.parameter_ptrs))
        with torch.autograd.graph.saved_tensors_hooks(self.counter.pack, self.counter.unpack):
            yield self.counter

    def peak_bytes(self, *, gradient_bytes: int, optimizer_bytes: int, transient_bytes: int) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.weights + self.counter.saved_bytes + gradient_bytes + optimizer_bytes + transient_bytes


T = TypeVar("T")


def live_tensor_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """What a trainer holds between steps: weights and buffers (the adapters' included), the optimizers'
    state and any gradients still held (accumulation)."""
    gradients: dict[int, int] = {}
    for parameter in model.parameters():
        if parameter.grad is not None:
            ptr, nbytes = _storage_key(parameter.grad)
            gradients[ptr] = max(gradients.get(ptr, 0), nbytes)
    return model_bytes(model) + sum(optimizer_state_bytes(o) for o in optimizers) + sum(gradients.values())


def measure_peak(run: Callable[[], T], device: torch.device) -> tuple[T, int]:
    result, peak, _ = measure_allocations(run, device)
    return result, peak


def measure_allocations(run: Callable[[], T], device: torch.device) -> tuple[T, int, int]:
    """Run `run()`; (its result, the peak bytes the allocator had live during it over those live before,
    and the bytes still live at its end over those before).

    CUDA: `max_memory_allocated` minus `memory_allocated` before. CPU: torch.profiler's memory events (the
    bytes of each allocation and free, in time order), their running sum's maximum: a real count of what
    the CPU allocator handed out, independent of what the engine thinks it keeps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = run()
        torch.cuda.synchronize(device)
        return (result, int(torch.cuda.max_memory_allocated(device)) - before,
                int(torch.cuda.memory_allocated(device)) - before)
    result, records = with_memory_records(run)
    peak, live = allocation_peak(records)
    return result, peak, live


# Kineto (torch's profiler library) prints two lines to stderr at each start and stop of a profile ("USDT:...
# SyncActivityProfilerHandler.cpp:52] profiler_start"), at its highest level, so that only the level above it
# (6: none) silences them; it reads KINETO_LOG_LEVEL when the process's first profile starts.
KINETO_SILENT = "6"


def start_memory_profile() -> None:
    """Turn torch's profiler on with memory records on and operation records off (only user scopes, which the
    engine does not open); `torch.autograd._disable_profiler()` turns it off and returns the records.
    Kineto's per-start lines are kept out of the process's stderr (a run in the terminal printed two per
    measured step) unless KINETO_LOG_LEVEL is set already: a user who asks for kineto's log keeps it. In a
    trainer's process only the memory measurement here starts profiles."""
    from torch._C._profiler import RecordScope, _ExperimentalConfig
    from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
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
    from torch.autograd import _disable_profiler

    start_memory_profile()
    try:
        result = run()
    finally:
        records = _disable_profiler()
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
        from torch.autograd import _disable_profiler
        peak, _ = allocation_peak(_disable_profiler())
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


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (the only one with `malloc_trim`), else None."""
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def release_free_heap() -> bool:
    """Give the pages of malloc's free heap blocks back to the system (glibc's `malloc_trim(0)`), so that the
    resident set is what is live (plus the runtime) and a measurement starting now counts what a step touches.
    Costs about a second and the pages are faulted in again when reused: for one-off measurements (the
    memory probe), never between training steps. Returns whether it ran: a no-op, logged, without glibc."""
    libc = _glibc()
    if libc is None:
        log.info("resident memory: %s without glibc: no malloc_trim, freed heap pages stay resident until reused",
                 platform.system())
        return False
    libc.malloc_trim(0)
    return True


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def resident_bytes() -> int:
    """This process's resident set now (Linux: VmRSS of /proc/self/status)."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int:
    """This process's peak resident set since it started or since the last `reset_peak_resident` (VmHWM; a CPU
    trainer resets it as each step begins)."""
    return _status_bytes("VmHWM")


_PEAK_BEFORE_RESETS = 0   # the highest VmHWM that a `measure_resident` reset took away


def process_peak_resident_bytes() -> int:
    """This process's peak resident set since it started: VmHWM, or the higher peak a `measure_resident` reset
    took away (the reset lowers VmHWM and getrusage's maxrss alike). Linux only."""
    return max(_PEAK_BEFORE_RESETS, peak_resident_bytes())


def resident_measurable() -> bool:
    """Whether `measure_resident` works here (Linux's /proc: VmHWM, and clear_refs to reset it)."""
    return Path("/proc/self/clear_refs").exists() and Path("/proc/self/status").exists()


def reset_peak_resident() -> None:
    """Start VmHWM again from the resident set now (Linux: /proc/self/clear_refs), so that the next reading of
    `peak_resident_bytes` is the peak of what runs from here; the process's own peak is kept
    (`process_peak_resident_bytes`). Only the counter is reset: no page is walked."""
    global _PEAK_BEFORE_RESETS
    _PEAK_BEFORE_RESETS = max(_PEAK_BEFORE_RESETS, peak_resident_bytes())   # the process's peak survives the reset
    Path("/proc/self/clear_refs").write_text("5")


def measure_resident(run: Callable[[], T]) -> tuple[T, int]:
    """Run `run()`; (its result, the process's peak resident set during it over the resident set before).
    Linux only: the peak (VmHWM) is reset first (`reset_peak_resident`)."""
    before = resident_bytes()
    reset_peak_resident()
    result = run()
    return result, peak_resident_bytes() - before
