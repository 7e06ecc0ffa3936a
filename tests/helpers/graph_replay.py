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
once, as on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


@dataclass
class RecordedStep:
    operations: list[tuple[Any, tuple, dict, list[torch.Tensor | None]]] = field(default_factory=list)
    fresh: bool = True   # captured just now: its computation already ran


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
        self.step.operations.append((func, args, kwargs, written))
        return out


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
