"""What a base layer keeps about its adapters from step to step on the CUDA LoRA path (actors/engine/lora_cuda.py):
`LayerAdapters`, kept on the layer while its adapters stay the same ones (`forget_masters` drops it, and the layer's
kept stacks, when an adapter leaves)."""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.lora_grad_kernel import GroupTargets
from actors.engine.lora_masters import GradientSink, compute_weights
from actors.engine.lora_stacks import KEPT

LAYER_ATTRIBUTE = "_aspen_lora_layer"


class LayerAdapters:
    """What a layer's adapters give every call while they stay the same ones, kept on the base layer
    (`forget_masters` drops it when an adapter leaves): the signature the step's structure depends on, their
    jobs' pools, each pooled adapter's copies (views of its job's cast) and gradient views, the others' float32
    masters. Per adapter and layer, these were most of a step's host time at many jobs (bench/gpu_cost_model.py
    --fusion): what is left per call is a few operations per layer, and a check per job of its cast's age."""

    def __init__(self, adapters: list[nn.Module]):
        self.adapters = list(adapters)
        self.ids = tuple(map(id, adapters))
        self.training = adapters[0].training
        self.signature = tuple(_job_of(adapter) for adapter in adapters)
        self.found = [adapter.master_pool for adapter in adapters]
        pools = {id(found[0]): found[0] for found in self.found if found is not None}
        self.pools = list(pools.values())
        self.unpooled = [index for index, found in enumerate(self.found) if found is None]
        self.copies: dict[torch.dtype, list] = {}
        self.routes: dict[tuple, tuple] = {}
        self.group_targets: dict[tuple, GroupTargets | None] = {}
        self.stack_members: dict[tuple, tuple[list, list]] = {}

    def weights(self, layout: object, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each adapter's (A, scaling * B) in `dtype`: a pooled job's cast refreshed once a step (and again where
        its masters changed in place since), the others cast as `compute_weights` casts them."""
        refreshed = layout.tensors.setdefault(("lora-refreshed", dtype), {})
        for pool in [pool for pool in self.pools if refreshed.get(id(pool)) != pool.flat._version]:
            pool.refresh(layout, dtype)
            refreshed[id(pool)] = pool.flat._version
        copies = self.copies.get(dtype)
        if copies is None:
            copies = self.copies[dtype] = [None if found is None else found[0].weights(adapter, found[1], found[2],
                                                                                       dtype)
                                           for adapter, found in zip(self.adapters, self.found, strict=True)]
        if not self.unpooled:
            return copies
        copies = list(copies)
        own = compute_weights(layout, [self.adapters[index] for index in self.unpooled], dtype)
        for index, pair in zip(self.unpooled, own, strict=True):
            copies[index] = pair
        return copies

    def members(self, dtype: torch.dtype, indices: list[int], member_of: list[int | None], copies: list
                ) -> tuple[list, list]:
        """(each group's adapter or None, the present ones' copies in order) for a grouped plan; kept per grouping
        where every adapter is pooled (their copies are then the same views from step to step)."""
        key = (dtype, tuple(indices), tuple(member_of))
        found = self.stack_members.get(key) if not self.unpooled else None
        if found is None:
            found = ([None if index is None else self.adapters[indices[index]] for index in member_of],
                     [copies[indices[index]] for index in member_of if index is not None])
            if not self.unpooled:
                self.stack_members[key] = found
        return found

    def takes_gradients(self) -> bool:
        """Whether this call's backward gives the pooled adapters gradients (grad mode on, adapters not frozen)."""
        return bool(self.pools) and torch.is_grad_enabled() and all(
            [pool.parameters[0].requires_grad for pool in self.pools])

    def targets(self, order: tuple[tuple[int, ...], ...], chosen: list[nn.Module], member_of: list[int | None],
                rank: int, device: torch.device) -> GroupTargets | None:
        """Where the first (grouped) plan's stacked gradients go, kept per grouping (`GroupTargets.of`)."""
        key = (order[0], tuple(member_of), rank)
        if key not in self.group_targets:
            self.group_targets[key] = GroupTargets.of(chosen, member_of, rank, device)
        return self.group_targets[key]

    def route(self, order: tuple[tuple[int, ...], ...], layout: object, taking: bool, stacked: bool = False
              ) -> tuple[GradientSink | None, tuple]:
        """(the sink of the pooled adapters' gradients or None, the masters autograd takes) for the plans'
        adapter order `order`; `stacked`: the first plan's gradients go into the buffers by themselves
        (`GroupTargets`) and are not in the list the sink takes. Without a gradient to take (`taking` False: no grad
        mode, frozen adapters), every master goes to autograd (which then computes none)."""
        key = (order, stacked)
        route = self.routes.get(key)
        if route is None:
            route = self.routes[key] = self._route(order[1:] if stacked else order)
        views, positions, returned, masters, every = route
        if not taking:
            return None, every
        if not positions:
            return None, masters
        return GradientSink(self.pools, views, positions, returned, layout.tensors), masters

    def _route(self, order: tuple[tuple[int, ...], ...]) -> tuple:
        views: list[torch.Tensor] = []
        positions: list[int] = []
        returned: list[int] = []
        masters: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        for place, index in enumerate(index for indices in order for index in indices):
            adapter, found = self.adapters[index], self.found[index]
            every.extend((adapter.lora_A, adapter.lora_B))
            if found is None:
                returned.extend((2 * place, 2 * place + 1))
                masters.extend((adapter.lora_A, adapter.lora_B))
            else:
                views.extend(found[0].grads.views_of(adapter))
                positions.extend((2 * place, 2 * place + 1))
        return views, positions, returned, tuple(masters), tuple(every)


def layer_adapters(base: nn.Module, adapters: list[nn.Module]) -> LayerAdapters:
    entry = base.__dict__.get(LAYER_ATTRIBUTE)
    if entry is None or entry.ids != tuple(map(id, adapters)) or entry.training != adapters[0].training:
        entry = LayerAdapters(adapters)
        base.__dict__[LAYER_ATTRIBUTE] = entry
    return entry


def forget_masters(base: nn.Module) -> None:
    base.__dict__.pop(LAYER_ATTRIBUTE, None)
    KEPT.forget(base)


def _job_of(adapter: nn.Module) -> tuple:
    """What of an adapter the step's structure depends on: its scaling, its dropout while training, its rank."""
    return adapter.scaling, adapter.dropout if adapter.drops else 0.0, adapter.r
