"""A CUDA device on a machine without one, for running the real step code: its device tensors are meta tensors
(shapes, dtypes and strides, no memory, no arithmetic) that call themselves `cuda:0`.

Why meta and not FakeTensorMode's fake "cuda" tensors: those run the forward, but autograd cannot record a
graph over them on a CPU-only build (every autograd node's input metadata asks the CUDA device guard for the
tensor's stream, and there is none: "PyTorch is not linked with support for cuda devices"). Meta tensors have
a device guard, so forward and backward run; the code above them is told they are on CUDA:

- `Tensor.is_cuda` is True, `Tensor.device` is cuda:0, `Tensor.is_meta` False for them (a torch function mode
  answers those property reads), so the engine takes its CUDA branches;
- a CUDA device given to a factory, `.to(...)`, `.cuda()` becomes meta;
- `torch.cuda.*` that the engine and its benchmarks call are stand-ins (synchronize, memory counters, device
  properties, streams and events), and a CUDA `torch.Generator` is a CPU one;
- a Triton kernel launch (`kernel[grid](...)`: Liger-Kernel's, the engine's own) is reported with its tensor
  arguments instead of run;
- `pin_memory()` marks the host tensor pinned (a CPU-only build cannot pin) and `is_pinned()` answers from
  that mark, so a pinned non-blocking copy is told from a blocking one;
- reading a device tensor on the host (`tolist`, `item`, `float`, `bool`, `numpy`, ...) is a synchronisation:
  it is reported to the listener and answers with the tensor's value where it is known (small tensors copied
  from the host, and what follows from them: `recorder.KernelRecorder` propagates them) or with a
  placeholder (zeros; True for a truth value).

What it cannot be: genuine meta tensors of the code under test (a pipeline stage's absent layers) would be
taken for device tensors."""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

CUDA = torch.device("cuda", 0)
META = torch.device("meta")
VALUE_LIMIT = 1 << 22   # elements: host values kept for integer and boolean device tensors up to this size
FLOAT_VALUE_LIMIT = 4096   # and for floating-point ones (scalings, token weights; not the adapters' weights)


def is_device_name(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def to_meta(value: object) -> object:
    return META if is_device_name(value) else value


class Listener:
    """What the virtual device reports: host synchronisations (a host read, torch.cuda.synchronize, an event's
    synchronize). `recorder.KernelRecorder` records them."""

    def sync(self, reason: str) -> None:   # pragma: no cover - the recorder's
        pass

    def python_call(self) -> None:   # pragma: no cover - the recorder's
        pass

    def triton(self, name: str, args: tuple, kwargs: dict,   # pragma: no cover - the recorder's
               rewritten: tuple = (), traffic: float | None = None) -> None:
        pass

    def harness(self, entering: bool) -> None:   # pragma: no cover - the recorder's
        """The harness's own code starts (True) or ends: its Python is not the step's."""


class _Properties(types.SimpleNamespace):
    pass


_ACTIVE: list[VirtualCuda] = []   # the device entered last (streams and events report to its listener)


def _sync(reason: str) -> None:
    if _ACTIVE:
        _ACTIVE[-1].listener.sync(reason)


class _Stream:
    """torch.cuda.Stream stand-in: every operation runs on one stream in the model (copies included)."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any):
        self.device = CUDA
        self.stream_id = 0   # torch.cuda.Stream's: the one stream's

    def synchronize(self) -> None:
        _sync("stream.synchronize")

    def wait_stream(self, _stream: Any) -> None:
        pass

    def wait_event(self, _event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


class _Event:
    def __init__(self, *_: Any, **__: Any):
        pass

    def record(self, _stream: Any = None) -> None:
        pass

    def wait(self, _stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _sync("event.synchronize")

    def elapsed_time(self, _other: Any) -> float:
        return 0.0


class _DeviceGuard:
    """torch.cuda.device stand-in: one device."""

    def __init__(self, device: Any = None):
        self.device = device

    def __enter__(self) -> _DeviceGuard:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


def _kernel_name(kernel: Any) -> str:
    inner = kernel
    while hasattr(inner, "fn") and not hasattr(inner, "__name__"):
        inner = inner.fn
    return getattr(inner, "__name__", type(kernel).__name__)


def _read_and_written(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The tensor arguments a kernel updates in place (read, then written), where it names them in its
    `read_and_written` (the engine's own kernels do: actors/engine/flat_adamw.py)."""
    names = getattr(kernel, "read_and_written", ())
    positions = {name: index for index, name in enumerate(getattr(kernel, "arg_names", ()))}
    found = []
    for name in names:
        value = kwargs.get(name, args[positions[name]] if positions.get(name, len(args)) < len(args) else None)
        if isinstance(value, torch.Tensor):
            found.append(value)
    return tuple(found)


def _traffic(kernel: Any, args: tuple, kwargs: dict) -> float | None:
    """The bytes a kernel moves where it says so itself (`traffic`: one that reaches memory through addresses in a
    table, not only through its tensor arguments: actors/engine/lora_grad_kernel.py)."""
    traffic = getattr(kernel, "traffic", None)
    return None if traffic is None else float(traffic(args, kwargs))


class _GeneratorType(type):
    """torch.Generator while the device is virtual: a CUDA generator is made on the CPU (the device's random
    operations draw nothing); isinstance still answers for every real generator."""

    real: type = torch.Generator

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, cls.real)

    def __call__(cls, device: Any = "cpu") -> torch.Generator:
        return cls.real("cpu" if is_device_name(device) else device)


class _VirtualGenerator(metaclass=_GeneratorType):
    pass


_PROPERTIES = {torch._C.TensorBase.is_cuda: "is_cuda", torch._C.TensorBase.device: "device",
               torch._C.TensorBase.is_meta: "is_meta"}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__complex__,
               torch.Tensor.__array__}
_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}
# calls that read a tensor's metadata: a fraction of a microsecond each, not counted as the host's work
_METADATA_CALLS = {torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.dim, torch.Tensor.size,
                   torch.Tensor.stride, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
                   torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
                   torch.Tensor.storage_offset, torch.Tensor.get_device, torch.Tensor.nelement,
                   torch.Tensor.ndimension, torch.Tensor.__len__, torch.Tensor.__hash__, torch.Tensor.__format__,
                   torch.Tensor.__repr__, torch.Tensor.requires_grad_, torch.is_complex, torch.is_floating_point,
                   torch.numel, torch.is_tensor, torch.Tensor.type, torch.Tensor.is_pinned}


_BACKWARDS = {None, torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}


class _DeviceMode(TorchFunctionMode):
    def __init__(self, owner: VirtualCuda):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        listener = self.owner.listener
        local = self.owner.local
        outer = getattr(local, "func", None)
        local.func = func
        listener.harness(True)
        try:
            return self._function(func, args, dict(kwargs or {}))
        finally:
            listener.harness(False)
            local.func = outer

    def _function(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        owner = self.owner
        if isinstance(func, types.MethodWrapperType):   # a property read: no call the host pays for
            if func.__self__ not in _PROPERTIES:
                return func(*args, **kwargs)
            tensor = args[0]
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return {"is_cuda": True, "device": CUDA, "is_meta": False}[_PROPERTIES[func.__self__]]
            return func(*args, **kwargs)
        if func not in _METADATA_CALLS:
            owner.listener.python_call()
        if func in _HOST_READS:
            return owner.host_read(func, args, kwargs)
        if func is torch.Tensor.get_device and args[0].is_meta:
            return 0
        if func is torch.Tensor.pin_memory:
            owner.mark_pinned(args[0])
            return args[0]
        if func is torch.Tensor.is_pinned:
            return owner.is_pinned(args[0])
        if func is torch.Tensor.cuda:
            return args[0].to(META, non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs:
            kwargs["device"] = to_meta(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(to_meta(a) for a in args)
        else:
            args = tuple(META if isinstance(a, torch.device) and a.type == "cuda" else a for a in args)
        pin = kwargs.pop("pin_memory", False) if "pin_memory" in kwargs else False
        if func in _DATA_FACTORIES and kwargs.get("device") == META:
            # built on the host, then copied over (as torch does for a CUDA device): the copy is recorded
            kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs).to(META)
        result = func(*args, **kwargs)
        if pin and isinstance(result, torch.Tensor):
            owner.mark_pinned(result)
        return result


class VirtualCuda:
    """`with VirtualCuda(listener): ...` runs code on the virtual device (module docstring)."""

    def __init__(self, listener: Listener | None = None, *, name: str = "NVIDIA H200", memory_bytes: int = 141 << 30,
                 multiprocessors: int = 132, capability: tuple[int, int] = (9, 0)):
        self.listener = listener or Listener()
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()   # device tensor -> host tensor of its value
        self.pinned: dict[int, torch.UntypedStorage] = {}        # data_ptr -> the pinned host storage
        self.properties = _Properties(name=name, total_memory=memory_bytes, multi_processor_count=multiprocessors,
                                      major=capability[0], minor=capability[1])
        self._stack = contextlib.ExitStack()

    # -- values and pinned memory --------------------------------------------------------------------
    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        return self.values.get(tensor)

    @staticmethod
    def keeps(tensor: torch.Tensor) -> bool:
        """Whether a value is kept for this device tensor (small index and count tensors, few floats)."""
        return tensor.numel() <= (FLOAT_VALUE_LIMIT if tensor.is_floating_point() else VALUE_LIMIT)

    def remember(self, tensor: torch.Tensor, value: torch.Tensor | None) -> None:
        if value is None or not self.keeps(tensor):
            self.values.pop(tensor, None)
        else:
            self.values[tensor] = value

    def forget(self, tensor: torch.Tensor) -> None:
        self.values.pop(tensor, None)

    def forget_floating(self) -> None:
        """Forget every floating-point value kept (a kernel that writes through a table of addresses may have
        written any of them); index and count values stay."""
        for tensor in [t for t, value in self.values.items() if value.is_floating_point()]:
            self.values.pop(tensor, None)

    def mark_pinned(self, tensor: torch.Tensor) -> None:
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            self.pinned[storage.data_ptr()] = storage

    def pinning_seen(self) -> bool:
        """Whether the device's function mode saw the code that made the tensor being copied (so that its
        `pin_memory` was answered here): not in an autograd backward's worker thread, nor in the callbacks at a
        backward's end (run inside the mode's handling of `backward`, where the mode is off)."""
        return getattr(self.local, "func", None) not in _BACKWARDS

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return not tensor.is_meta and tensor.untyped_storage().data_ptr() in self.pinned

    def host_read(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A device tensor read on the host: a synchronisation; answered from its value where known."""
        tensor = args[0]
        if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
            return func(*args, **kwargs)
        self.listener.sync(func.__name__)
        return func(self.host_copy(tensor), *args[1:], **kwargs)

    def host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor a device tensor's copy would give: its value where known, else a placeholder
        (zeros; ones for booleans, so that checks such as `isfinite(x).all()` pass)."""
        value = self.values.get(tensor)
        if value is not None and value.shape == tensor.shape:
            return value.clone()
        fill = torch.ones if tensor.dtype == torch.bool else torch.zeros
        return fill(tensor.shape, dtype=tensor.dtype)

    # -- entering ----------------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._stack.callback(setattr, owner, name, old)

    def __enter__(self) -> VirtualCuda:
        self.local = threading.local()   # the function its mode handles in this thread (`pinning_seen`)
        cuda = torch.cuda
        listener = self.listener
        patches: dict[str, Any] = {
            "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
            "is_initialized": lambda: True, "init": lambda: None, "set_device": lambda _d: None,
            "synchronize": lambda device=None: listener.sync("torch.cuda.synchronize"),
            "get_device_name": lambda device=None: self.properties.name,
            "get_device_properties": lambda device=None: self.properties,
            "get_device_capability": lambda device=None: (self.properties.major, self.properties.minor),
            "is_bf16_supported": lambda *a, **k: True,
            "memory_allocated": lambda device=None: 0, "max_memory_allocated": lambda device=None: 0,
            "memory_reserved": lambda device=None: 0, "max_memory_reserved": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None, "empty_cache": lambda: None,
            "manual_seed": lambda seed: None, "manual_seed_all": lambda seed: None,
            "get_rng_state_all": lambda: [], "set_rng_state_all": lambda states: None,
            "get_rng_state": lambda device=None: torch.zeros(16, dtype=torch.uint8),
            "set_rng_state": lambda state, device=None: None,
            "mem_get_info": lambda device=None: (self.properties.total_memory, self.properties.total_memory),
            "Stream": _Stream, "current_stream": lambda device=None: _Stream(),
            "default_stream": lambda device=None: _Stream(),
            "stream": lambda stream=None: contextlib.nullcontext(stream), "Event": _Event, "device": _DeviceGuard,
        }
        for name, value in patches.items():
            if hasattr(cuda, name):
                self._patch(cuda, name, value)
        self._patch(torch, "Generator", _VirtualGenerator)
        self._patch_triton()
        _ACTIVE.append(self)
        self._stack.callback(_ACTIVE.remove, self)
        self._stack.enter_context(_DeviceMode(self))
        return self

    def _patch_triton(self) -> None:
        """A Triton kernel (Liger's, or one of the engine's own) launched on the device is reported to the
        listener with its tensor arguments instead of compiled and run."""
        try:
            from triton.runtime.jit import KernelInterface
        except ImportError:   # no Triton: nothing launches one
            return
        listener = self.listener

        def getitem(kernel: Any, grid: Any) -> Callable:
            def launch(*args: Any, **kwargs: Any) -> None:
                listener.harness(True)   # the recording's Python (the kernel's own `traffic` too) is not the step's
                try:
                    listener.triton(_kernel_name(kernel), args, kwargs, _read_and_written(kernel, args, kwargs),
                                    _traffic(kernel, args, kwargs))
                finally:
                    listener.harness(False)

            return launch

        self._patch(KernelInterface, "__getitem__", getitem)

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
