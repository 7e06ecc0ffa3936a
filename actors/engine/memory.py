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
import platform
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from actors.engine.memory_profile import allocation_peak, with_memory_records

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
        # whether a step's peak resident set is measured too (a CPU with Linux's /proc: `measure_resident`)
        self.resident = device.type == "cpu" and resident_measurable()

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
