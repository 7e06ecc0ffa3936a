"""The stacks of the jobs' compute-dtype copies that `torch._grouped_mm` reads for a layer (actors/engine/lora_cuda.py):
A stacked (groups, rank, in) and scaling * B stacked (groups, out, rank), a group of no adapter zeros.

Where every adapter of a layer is pooled and of one rank (every job on the CUDA path, the usual case), the layer's
stacks are kept from step to step (`KEPT`, one grouping a layer: the latest) and refreshed all together, every
layer's in one multi-tensor copy from the jobs' copies, at the first layer that finds its kept stacks after any copy
was written (an optimizer step, a refresh: `lora_masters.casts_written`). Made a layer at a time, the stacks cost two
launches a layer and step: on the 8B shape some 450 of the forward's launches, and its host time with them
(bench/gpu_cost_model.py: the forward's host work was longer than its GPU work, so the GPU waited). The kept stacks
stay allocated between steps (2 bytes per adapter parameter, which the step made and freed before)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from actors.engine.lora_masters import RANK_ALIGNMENT, casts_written, compute_weights, step_tensors


class KeptStacks:
    """Every layer's pooled stacks kept between steps: per layer (by identity, while it lives) the latest grouping's
    (A stack, B stack) and, for the refresh, each present group's slots and the copies they are made from."""

    def __init__(self):
        self.entries: dict[int, tuple] = {}   # id(layer) -> (layer ref, key, stacks, targets, sources)
        self.lists: tuple[list, list] | None = None   # every entry's targets and sources, made when entries change
        self.stamp: int | None = None   # `casts_written` when every entry was last made current

    def find(self, layer: nn.Module, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        entry = self.entries.get(id(layer))
        if entry is None or entry[0]() is not layer or entry[1] != key:
            return None
        return entry[2]

    def keep(self, layer: nn.Module, key: tuple, stacks: tuple[torch.Tensor, torch.Tensor], targets: list,
             sources: list) -> None:
        """Keep `layer`'s stacks of grouping `key` (made current now), in place of its earlier grouping's (and until
        the layer is gone)."""
        ident = id(layer)
        self.entries[ident] = (weakref.ref(layer, lambda _: self._drop(ident)), key, stacks, targets, sources)
        self.lists = None

    def _drop(self, ident: int) -> None:
        entry = self.entries.get(ident)
        if entry is not None and entry[0]() is None:
            del self.entries[ident]
            self.lists = None

    def refresh(self) -> None:
        """Every kept stack made current from the jobs' copies, where any copy was written since the last time."""
        written = casts_written()
        if self.stamp == written:
            return
        if self.lists is None:
            self.lists = ([t for entry in self.entries.values() for t in entry[3]],
                          [s for entry in self.entries.values() for s in entry[4]])
        with torch.no_grad():
            torch._foreach_copy_(*self.lists)
        self.stamp = written

    def forget(self, layer: nn.Module) -> None:
        if self.entries.pop(id(layer), None) is not None:
            self.lists = None


KEPT = KeptStacks()


def padded_rank(adapters: Sequence[nn.Module]) -> int:
    longest = max(a.r for a in adapters)
    return -(-longest // RANK_ALIGNMENT) * RANK_ALIGNMENT


def stacked_weights(layout: object, layer: nn.Module, members: Sequence[nn.Module | None], dtype: torch.dtype,
                    weights: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, pooled: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(A stacked (groups, rank, in), scaling * B stacked (groups, out, rank)) in `dtype` for `layer`'s groups; a
    group of None (tokens of no plain adapter) is zeros. Adapters of one rank, a multiple of 8: one stack each of
    their (pooled) copies; else zeros, ranks padded to `padded_rank`, filled adapter by adapter. `weights`: the
    present members' copies in order, where the caller has them (else `compute_weights`). `pooled`: every member is
    pooled (the stack is then current while `casts_written` stays, and kept between steps: `KEPT`; else made each
    step, current while each member's copy stays)."""
    tensors = step_tensors(layout)
    key = ("lora-stack", id(layer), dtype, tuple(map(id, members)), casts_written() if pooled else tuple(
        [member.master_pool[0].generation if member.master_pool else (member.lora_A._version, member.lora_B._version)
         for member in members if member is not None]))
    if key in tensors:
        return tensors[key]
    present = [member for member in members if member is not None]
    ranks = {member.r for member in present}
    uniform = len(ranks) == 1 and next(iter(ranks)) % RANK_ALIGNMENT == 0
    if pooled and uniform:
        kept = KEPT.find(layer, (dtype, key[3]))
        if kept is not None:
            KEPT.refresh()
            tensors[key] = kept
            return kept
    if weights is None:
        weights = compute_weights(layout, present, dtype)
    in_features, out_features = present[0].lora_A.shape[1], present[0].lora_B.shape[0]
    device = present[0].lora_A.device
    pairs = iter(weights)
    if uniform:
        rank = next(iter(ranks))
        zeros = _zeros(tensors, (rank, in_features), (out_features, rank), dtype, device)
        chosen = [next(pairs) if member is not None else zeros for member in members]
        a_stack = torch.stack([pair[0] for pair in chosen])
        b_stack = torch.stack([pair[1] for pair in chosen])
        if pooled:
            present_groups = [group for group, member in enumerate(members) if member is not None]
            KEPT.keep(layer, (dtype, key[3]), (a_stack, b_stack),
                      [a_stack[group] for group in present_groups] + [b_stack[group] for group in present_groups],
                      [chosen[group][0] for group in present_groups] + [chosen[group][1] for group in present_groups])
    else:
        rank = padded_rank(present)
        a_stack = torch.zeros(len(members), rank, in_features, dtype=dtype, device=device)
        b_stack = torch.zeros(len(members), out_features, rank, dtype=dtype, device=device)
        for index, member in enumerate(members):
            if member is not None:
                lora_a, lora_b = next(pairs)
                a_stack[index, :member.r].copy_(lora_a)
                b_stack[index, :, :member.r].copy_(lora_b)
    tensors[key] = (a_stack, b_stack)
    return a_stack, b_stack


def _zeros(tensors: dict, shape_a: tuple[int, int], shape_b: tuple[int, int], dtype: torch.dtype,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A gap group's zero weights of these shapes, one pair a step."""
    key = ("lora-zeros", shape_a, shape_b, dtype, str(device))
    if key not in tensors:
        tensors[key] = (torch.zeros(shape_a, dtype=dtype, device=device), torch.zeros(shape_b, dtype=dtype,
                                                                                      device=device))
    return tensors[key]
