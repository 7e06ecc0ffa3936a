"""A CPU stand-in for CUDA graphs (actors/engine/step_graphs.py's `GraphBackend`), for tests without a GPU.

`capture` runs the step once under a dispatch mode that records every operation (the function, its arguments as
the very tensor objects and Python values they were, its outputs); `replay` runs the recorded operations again in
order, with the same tensors, without the Python that issued them, and writes each out-of-place result into the
tensor the capture made (so the operations after it read the new values, as a graph's kernels read their captured
addresses). What a CUDA graph would get wrong, this gets wrong too: a host number baked into an operation (a
sequence's length, a slice's bound), a tensor made afresh from host values during the step (its captured values
are replayed), Python state the step changes besides its kernels. A host read inside the step (`.item()`,
`.tolist()`, a data-dependent shape) raises, as it would stop a capture. Capture runs the step (a CUDA capture
only records it), so the first replay after a capture is skipped: capture and replay together compute the step
once, as on a GPU.

Memory: what the step makes during its capture lives with the graph (a CUDA graph's private pool), so the recording
holds it; a tensor made before the capture (weights, the jobs' buffers, kept stacks, static inputs) is the caller's
to keep alive, so the recording holds it only weakly, and a replay that finds one gone raises: on a GPU it would read
freed memory, which may hold anything by then."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


@dataclass
class RecordedStep:
    operations: list[tuple[Any, tuple, dict, list[torch.Tensor | None]]] = field(default_factory=list)
    fresh: bool = True   # captured just now: its computation already ran
    made: dict[int, torch.Tensor] = field(default_factory=dict)   # id -> every tensor the capture made (held)


class _Before:
    """A tensor made before the capture, held weakly (module docstring)."""

    def __init__(self, tensor: torch.Tensor, func: Any):
        self.ref, self.func = weakref.ref(tensor), func
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def get(self) -> torch.Tensor:
        tensor = self.ref()
        if tensor is None:
            raise RuntimeError(f"the replay reads a tensor freed since its capture ({self.dtype} {list(self.shape)}, "
                               f"an input of {self.func}): on a GPU it would read freed memory")
        return tensor


class _Recorder(TorchDispatchMode):
    def __init__(self, step: RecordedStep):
        super().__init__()
        self.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            raise RuntimeError(f"operation not permitted when stream is capturing: {func} reads a value on the host")
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        returns = func._schema.returns
        written: list[torch.Tensor | None] = []
        for index, value in enumerate(outputs):   # a list return (split's views) is one schema return
            aliased = bool(returns) and returns[min(index, len(returns) - 1)].alias_info is not None
            written.append(value if isinstance(value, torch.Tensor) and not aliased else None)
        made = self.step.made
        held_args, held_kwargs = tree_map(lambda value: self._held(value, func), (args, kwargs))
        for value in outputs:
            if isinstance(value, torch.Tensor):
                made[id(value)] = value
        self.step.operations.append((func, held_args, held_kwargs, written))
        return out

    def _held(self, value: Any, func: Any) -> Any:
        if isinstance(value, torch.Tensor) and self.step.made.get(id(value)) is not value:
            return _Before(value, func)
        return value


class ReplayGraphs:
    """`GraphBackend` on the CPU: capture records, replay re-runs (module docstring). `captured`: the steps."""

    def __init__(self) -> None:
        self.captured: list[RecordedStep] = []
        self.replayed = 0

    def warm(self, run: Callable[[], Any]) -> Any:
        return run()

    def capture(self, run: Callable[[], Any]) -> tuple[RecordedStep, Any]:
        step = RecordedStep()
        with _Recorder(step):
            out = run()
        self.captured.append(step)
        return step, out

    def replay(self, step: RecordedStep) -> None:
        if step.fresh:
            step.fresh = False
            return
        self.replayed += 1
        with torch.no_grad():
            for func, args, kwargs, written in step.operations:
                args, kwargs = tree_map(lambda value: value.get() if isinstance(value, _Before) else value,
                                        (args, kwargs))
                out = func(*args, **kwargs)
                outputs, _ = tree_flatten(out)
                for target, value in zip(written, outputs, strict=False):
                    if target is not None:
                        target.copy_(value)


class WarmOnly:
    """`GraphBackend` that never captures: every step runs eagerly in its fixed shape (the reference a replay is
    compared with)."""

    def warm(self, run: Callable[[], Any]) -> Any:
        return run()

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        raise AssertionError("WarmOnly never captures: set step_graphs.WARMUP past the test's steps")

    def replay(self, graph: Any) -> None:
        raise AssertionError("WarmOnly has no graph to replay")
