"""The jobs' float32 LoRA masters on the CUDA path (actors/engine/lora_cuda.py): their compute-dtype copies, made
once a step, and the flat buffer their gradients are added into.

A job's plain adapters are pooled (`adapter_surgery.pool_masters`): every A, then every B, are views of one flat
float32 tensor. `MasterPool` keeps that tensor's copy in a compute dtype (the Bs times the job's scaling), refreshed
in place once a step, each layer's copies views of it; and a flat float32 gradient buffer of the same layout whose
views are the parameters' `.grad`: the path's backward adds each layer's gradients of every job into those views in
one multi-tensor operation, where autograd would run two accumulation nodes per job and layer (on a GPU the host's
work grew with the jobs: at 32 jobs they were the largest part of a step's host time in bench/gpu_cost_model.py)."""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

RANK_ALIGNMENT = 8   # grouped_mm: 16-byte strides, 8 bfloat16 elements
# id of a pool's first parameter -> the pool (`pool_of`; the pool holds that parameter, so the id is a live one's)
_POOLS: weakref.WeakValueDictionary[int, MasterPool] = weakref.WeakValueDictionary()
_CASTS_WRITTEN = [0]   # how many times any pool's compute-dtype copy was written (`casts_written`)
_EVERY_REFRESH = [False]   # `every_refresh`: a step being captured as a graph refreshes whatever it could skip


def casts_written() -> int:
    """A count that moves whenever any pool's compute-dtype copy is written (a refresh, an optimizer step): what was
    made from the copies at one count (a layer's stack of them) is current while the count stays."""
    return _CASTS_WRITTEN[0]


@contextlib.contextmanager
def every_refresh() -> Iterator[None]:
    """Inside: every once-a-step refresh of the jobs' copies runs, even where it is current (a pool's cast, the kept
    stacks: lora_stacks.KeptStacks.refresh). For a step captured as a graph (actors/engine/step_graphs.py): a replay
    runs the kernels its capture launched and none of the checks that chose them, so a refresh the capture skipped
    (nothing had changed since the step before, as after a step that only accumulated gradients) would be missing
    from every later step, whose adapters the optimizer changed."""
    _EVERY_REFRESH[0] = True
    try:
        yield
    finally:
        _EVERY_REFRESH[0] = False


def refresh_every_time() -> bool:
    return _EVERY_REFRESH[0]


class MasterPool:
    """One job's float32 masters (every A, then every B, of its plain adapters: `adapter_surgery.pool_masters`)
    and their copy in a compute dtype: kept from step to step and refreshed in place once a step (the As copied,
    the Bs times the job's scaling: two operations for the whole adapter), each layer's copies views made once.
    Refreshed in place: a backward still to come reads the values of its forward, since a job's weights change
    only at its optimizer step, after the backward of every micro-batch of its accumulation (on one device and in
    a pipeline's stages alike); between those, a refresh writes the same values again.

    Gradients (`grads`, a `GradientBuffer`): each parameter's `.grad` is a view of one flat float32 buffer while
    the optimizer keeps the gradients; once it clears them, the next backward zeroes the buffer and attaches the
    views again, so a job that took no part in a step keeps None."""

    def __init__(self, flat: torch.Tensor, b_region: int, scaling: float,
                 parameters: Sequence[nn.Parameter] = ()):
        self.flat, self.b_region, self.scaling = flat, b_region, scaling
        self.parameters = list(parameters)   # every A, then every B, as views of `flat` (pool_masters' order)
        self.casts: dict[torch.dtype, torch.Tensor] = {}
        self.views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        # dtype -> (a weak reference to the step's layout, flat's version): a strong one would keep the step's
        # layout, and whatever its tensors hold (activations, their graph), alive until the next step
        self.refreshed: dict[torch.dtype, tuple[weakref.ref, int]] = {}
        self.current: dict[torch.dtype, int] = {}   # dtype -> flat's version its cast was written at by a step
        self.generation = 0
        self.grads = GradientBuffer(flat, self.parameters)
        if self.parameters:
            _POOLS[id(self.parameters[0])] = self

    def __deepcopy__(self, memo: dict) -> MasterPool:
        """A copy of its own (`copy.deepcopy` of a model or layer holding pooled adapters): a new flat tensor, each
        copied parameter made a view of it where the original's was (a parameter's own deep copy is a clone of its
        values, no view of anything, so the copy's gradients would be added at the wrong places), no gradients (as
        torch copies a parameter), and nothing kept that is keyed by the original's objects or addresses."""
        copied = MasterPool.__new__(MasterPool)
        memo[id(self)] = copied
        flat = self.flat.detach().clone()
        parameters = [copy.deepcopy(parameter, memo) for parameter in self.parameters]
        for original, parameter in zip(self.parameters, parameters, strict=True):
            start = original.storage_offset() - self.flat.storage_offset()
            parameter.data = flat[start:start + original.numel()].view(original.shape)
        copied.__init__(flat, self.b_region, self.scaling, parameters)
        return copied

    def refresh(self, layout: object, dtype: torch.dtype) -> None:
        """The copy in `dtype` as of now, once a step (and again where the masters changed in place since)."""
        stamp = (weakref.ref(layout), self.flat._version)
        seen = self.refreshed.get(dtype)
        if seen is not None and seen[0]() is layout and seen[1] == stamp[1]:
            return
        if self.current.get(dtype) == stamp[1] and not _EVERY_REFRESH[0]:   # the optimizer's step wrote it
            self.refreshed[dtype] = stamp
            return
        cast = self.casts.get(dtype)
        if cast is None:
            cast = self.casts[dtype] = torch.empty(self.flat.shape, dtype=dtype, device=self.flat.device)
        flat = self.flat.detach()
        cast[:self.b_region].copy_(flat[:self.b_region])
        torch.mul(flat[self.b_region:], self.scaling, out=cast[self.b_region:])
        self.refreshed[dtype] = stamp
        self.generation += 1
        _CASTS_WRITTEN[0] += 1

    def stepped(self, dtype: torch.dtype | None) -> None:
        """The optimizer's step (actors/engine/flat_adamw.py) changed the masters, wrote their copy in `dtype` (None:
        none) and zeroed the gradient buffer."""
        self.current = {} if dtype is None else {dtype: self.flat._version}
        if dtype is not None:
            self.generation += 1
            _CASTS_WRITTEN[0] += 1
        self.grads.zeroed = True

    def weights(self, adapter: nn.Module, start_a: int, start_b: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(adapter), dtype)
        if key not in self.views:
            cast = self.casts[dtype]
            self.views[key] = (cast[start_a:start_a + adapter.lora_A.numel()].view(adapter.lora_A.shape),
                               cast[start_b:start_b + adapter.lora_B.numel()].view(adapter.lora_B.shape))
        return self.views[key]


class GradientBuffer:
    """A pool's gradients: one flat float32 buffer in its masters' layout (made at the first view asked for), whose
    views are the parameters' `.grad` while the optimizer keeps the gradients; once it clears them (sets them to None,
    as `zero_grad` does), the next backward zeroes the buffer and attaches the views again (`attach`)."""

    def __init__(self, masters: torch.Tensor, parameters: list[nn.Parameter]):
        self.masters, self.parameters = masters, parameters   # the pool's flat masters, its parameters (views of them)
        self.values: torch.Tensor | None = None
        self.zeroed = False   # the buffer holds zeros (an optimizer step cleared it), so no fill is due
        self._views: dict[int, torch.Tensor] = {}   # id(parameter) -> its view of `values`
        self._all_views: list[torch.Tensor] | None = None   # every parameter's, in `parameters`' order

    def views_of(self, adapter: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The views of the buffer that are `adapter`'s A's and B's `.grad` once attached."""
        return self._view(adapter.lora_A), self._view(adapter.lora_B)

    def _view(self, parameter: torch.Tensor) -> torch.Tensor:
        view = self._views.get(id(parameter))
        if view is None:
            if self.values is None:
                self.values = torch.zeros(self.masters.shape, dtype=torch.float32, device=self.masters.device)
            start = parameter.storage_offset() - self.masters.storage_offset()
            view = self.values[start:start + parameter.numel()].view(parameter.shape)
            self._views[id(parameter)] = view
        return view

    def attached(self) -> bool:
        """Whether every parameter's `.grad` is its view of the buffer (checked at both ends: the optimizers
        clear a job's gradients all together)."""
        first, last = self.parameters[0], self.parameters[-1]
        view = self._views.get(id(first))
        return view is not None and first.grad is view and last.grad is self._views.get(id(last))

    def attach(self) -> None:
        """Make every parameter's `.grad` its view of the buffer, keeping the values of gradients it holds (a
        gradient cleared to None starts from zeros)."""
        if not self.parameters:
            return
        if self.attached():   # gradients are added into the buffer from here on
            self.zeroed = False
            return
        views = self._all_views
        if views is None:
            views = self._all_views = [self._view(parameter) for parameter in self.parameters]
        held = [parameter.grad for parameter in self.parameters]
        with torch.no_grad():
            if held.count(None) == len(held):   # the usual case: the optimizer cleared them; one fill
                if not self.zeroed:
                    self.values.zero_()
            else:
                for view, grad in zip(views, held, strict=True):
                    if grad is None:
                        view.zero_()
                    elif grad is not view:
                        view.copy_(grad)
        for parameter, view in zip(self.parameters, views, strict=True):
            parameter.grad = view
        self.zeroed = False


def pool_of(parameters: Sequence[nn.Parameter]) -> MasterPool | None:
    """The pool whose parameters these are, led by the same first one (`adapter_surgery.pool_masters`), or None."""
    if not parameters:
        return None
    pool = _POOLS.get(id(parameters[0]))
    return pool if pool is not None and pool.parameters[0] is parameters[0] else None


class GradientSink:
    """Where a layer's pooled adapters' gradients go (lora_cuda's autograd function hands its backward's list here):
    `views`, each its parameter's view of its job's gradient buffer, for the gradients at `positions` of the
    layer's list; the rest (`returned`) go back to autograd. Each pool's views become its parameters' `.grad` at
    the first backward of a step that reaches it (`GradientBuffer.attach`: once per pool and step, through the
    step's `tensors`)."""

    def __init__(self, pools: list, views: list[torch.Tensor], positions: list[int], returned: list[int],
                 tensors: dict):
        self.pools, self.views, self.positions, self.returned, self.tensors = pools, views, positions, returned, tensors

    def add(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        attach_pools(self.pools, self.tensors)
        positions = self.positions
        with torch.no_grad():
            torch._foreach_add_(self.views, [grads[index] for index in positions])
        return [grads[index] for index in self.returned]


def attach_pools(pools: Sequence[MasterPool], tensors: dict) -> None:
    """Each pool's views made its parameters' `.grad` (`GradientBuffer.attach`), once per pool and step (`tensors`:
    the step's), before a backward first adds into them."""
    attached = tensors.setdefault("lora-grads-attached", set())
    for pool in pools:
        if id(pool) not in attached:
            pool.grads.attach()
            attached.add(id(pool))


def compute_weights(layout: object, adapters: Sequence[nn.Module], dtype: torch.dtype
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per adapter (A (r, in), scaling * B (out, r)) in `dtype`. A job's adapter pooled in one flat tensor
    (`adapter_surgery.pool_masters`, as every job's is) is cast whole, once a step (`MasterPool`): its layers'
    copies are views of that cast; another adapter is cast by itself. A weight changed in place since (an
    optimizer step, a load) is cast again."""
    tensors = layout.tensors
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for adapter in adapters:
        found = adapter.master_pool
        if found is None:
            lora_a, lora_b = adapter.lora_A, adapter.lora_B
            key, version = ("lora-cast", id(adapter), dtype), (lora_a._version, lora_b._version)
            entry = tensors.get(key)
            if entry is None or entry[0] != version:
                entry = tensors[key] = (version, (lora_a.detach().to(dtype),
                                                  (lora_b.detach() * adapter.scaling).to(dtype)))
            out.append(entry[1])
            continue
        pool, start_a, start_b = found
        pool.refresh(layout, dtype)
        out.append(pool.weights(adapter, start_a, start_b, dtype))
    return out
