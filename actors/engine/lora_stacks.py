"""The stacks of the jobs' compute-dtype copies that `torch._grouped_mm` reads for a layer (actors/engine/lora_cuda.py):
A stacked (groups, rank, in) and scaling * B stacked (groups, out, rank), a group of no adapter zeros.

Where every adapter of a layer is pooled and of one rank (every job on the CUDA path, the usual case), the layer's
stacks are kept from step to step (`KEPT`, up to `GROUPINGS` groupings of adapters a layer) and refreshed all
together, every layer's in one multi-tensor copy from the jobs' copies, at the first layer that finds its kept stacks
after any copy was written (an optimizer step, a refresh: `lora_masters.casts_written`): one Triton kernel over a
table of every slot's source and target addresses (`copy_slots`; a multi-tensor copy where Triton is missing or the
kernel fails its once-a-device check). Made a layer at a time, the stacks cost two
launches a layer and step: on the 8B shape some 450 of the forward's launches, and its host time with them
(bench/gpu_cost_model.py: the forward's host work was longer than its GPU work, so the GPU waited). The kept stacks
stay allocated between steps (2 bytes per adapter parameter, which the step made and freed before)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from actors.engine.lora_masters import RANK_ALIGNMENT, casts_written, compute_weights
from actors.engine.triton_support import KernelCheck, tl, triton, triton_runs

# keep the pooled stacks between steps (False: made each step, as before; bench/gpu_cost_model.py --set ranks the two)
KEEP = True
# groupings of adapters whose stacks a layer keeps: the step's and one more (an evaluation's, a generation's, a step
# of fewer jobs), the least recently used dropped; each costs 2 bytes per parameter of its adapters
GROUPINGS = 2
BLOCK = 4096
_TABLE_BYTES: dict[int, float] = {}   # id(a slot table on the device) -> bytes its copy moves (the cost model's)

if triton is not None:
    @triton.jit
    def _copy_slots_kernel(table, BLOCK_SIZE: tl.constexpr):
        """Row `slot` of `table` (source address, target address, count of 2-byte units, units a target row, units
        between target rows: a contiguous source into a contiguous target, or into a block of a wider matrix, as the
        stacks of layers sharing an input hold their Bs): one block of its copy. A program past a shorter slot's end
        does nothing; offsets inside a slot are 32-bit (`copy_slots` keeps slots under 2**31 units), a contiguous
        target is written without dividing."""
        slot = tl.program_id(0).to(tl.int64)
        count = tl.load(table + slot * 5 + 2).to(tl.int32)
        begin = tl.program_id(1) * BLOCK_SIZE
        if begin < count:
            source = tl.load(table + slot * 5).to(tl.pointer_type(tl.int16))
            target = tl.load(table + slot * 5 + 1).to(tl.pointer_type(tl.int16))
            row = tl.load(table + slot * 5 + 3).to(tl.int32)
            stride = tl.load(table + slot * 5 + 4).to(tl.int32)
            offsets = begin + tl.arange(0, BLOCK_SIZE)
            inside = offsets < count
            values = tl.load(source + offsets, mask=inside, other=0)
            if row == stride:
                tl.store(target + offsets, values, mask=inside)
            else:
                tl.store(target + (offsets // row) * stride + offsets % row, values, mask=inside)

    # bench/gpu_cost_model.py: the slots are reached through addresses, so the kernel says what it moves
    _copy_slots_kernel.traffic = lambda args, kwargs: _TABLE_BYTES.get(id(args[0]), 0.0)


def copy_slots(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> tuple | None:
    """Copy every source into its target (contiguous, of one device, 2 or 4 bytes an element) in one launch of
    `_copy_slots_kernel`, where it runs and passed its check on the device; returns (the device table, its host copy)
    to launch again with `launch_slots` (the addresses do not change), or None where the kernel does not run (the
    caller then copies with torch)."""
    device = targets[0].device
    if not (triton_runs(device) and CHECK.works(device)):
        return None
    rows = [_slot(target, source) for target, source in zip(targets, sources, strict=True)]
    if any(row[2] >= 2 ** 31 or (row[2] // max(row[3], 1)) * row[4] >= 2 ** 31 for row in rows):
        return None   # (no LoRA stack comes near: the kernel's offsets inside a slot are 32-bit)
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    table = host.to(device, non_blocking=True)
    longest = max(row[2] for row in rows)
    _TABLE_BYTES[id(table)] = float(2 * sum(t.numel() * t.element_size() for t in targets))
    return table, host, len(rows), longest


def _slot(target: torch.Tensor, source: torch.Tensor) -> tuple[int, int, int, int, int]:
    """A slot's table row: a contiguous source; a contiguous target, or a 2-d one whose rows are contiguous."""
    units = target.element_size() // 2
    if target.is_contiguous():
        count = target.numel() * units
        return source.data_ptr(), target.data_ptr(), count, count, count
    if target.dim() != 2 or target.stride(1) != 1 or not source.is_contiguous():
        raise ValueError(f"a stack slot of shape {tuple(target.shape)} and strides {target.stride()}: the copy kernel "
                         "takes contiguous sources and targets of contiguous rows")
    return (source.data_ptr(), target.data_ptr(), target.numel() * units, target.shape[1] * units,
            target.stride(0) * units)


def launch_slots(slots: tuple) -> None:
    table, _, count, longest = slots
    _copy_slots_kernel[(count, triton.cdiv(longest, BLOCK))](table, BLOCK_SIZE=BLOCK)


def forget_slots(slots: tuple | None) -> None:
    if slots is not None:
        _TABLE_BYTES.pop(id(slots[0]), None)


def _agrees(device: torch.device) -> bool:
    """Three slots of 5, 3000 and 9000 bfloat16 elements, one of 700 float32 ones and a (6, 3) block of a (9, 8)
    bfloat16 matrix copied: each target equal to its source, the elements around them untouched."""
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=generator).to(device=device, dtype=dtype)
               for n, dtype in ((5, torch.bfloat16), (3000, torch.bfloat16), (9000, torch.bfloat16),
                                (700, torch.float32), (18, torch.bfloat16))]
    sources[4] = sources[4].view(6, 3)
    arena = torch.zeros(13000, dtype=torch.bfloat16, device=device)
    wide = torch.zeros(702, dtype=torch.float32, device=device)
    matrix = torch.zeros(9, 8, dtype=torch.bfloat16, device=device)
    targets = [arena[1:6], arena[10:3010], arena[3020:12020], wide[1:701], matrix[2:8, 4:7]]
    table = torch.tensor([_slot(t, s) for t, s in zip(targets, sources, strict=True)], dtype=torch.int64).to(device)
    _copy_slots_kernel[(len(targets), triton.cdiv(9000, BLOCK))](table, BLOCK_SIZE=BLOCK)
    copied = all(bool((t == s).all()) for t, s in zip(targets, sources, strict=True))
    outside = matrix.clone()
    outside[2:8, 4:7] = 0
    untouched = (bool((arena[0] == 0).all()) and bool((arena[6:10] == 0).all()) and bool((arena[12020:] == 0).all())
                 and bool((wide[0] == 0).all()) and bool((wide[701] == 0).all()) and bool((outside == 0).all()))
    return copied and untouched


CHECK = KernelCheck("the stacks' copy kernel", "the stacks are refreshed by a multi-tensor copy", _agrees)


class KeptStacks:
    """Every layer's pooled stacks kept between steps: per layer (by identity, while it lives) and grouping of adapters
    (at most `GROUPINGS` a layer, the least recently used dropped first) the (A stack, B stack) and, for the refresh,
    each present group's slots and the copies they are made from. Several groupings a layer, so that an evaluation, a
    generation or an interactive call between steps (other adapters through the layer) keeps its stacks beside the
    step's instead of replacing them (a step captured as a graph reads the step's: step_graphs.py captures again
    whenever one is dropped)."""

    def __init__(self):
        # (id(layer), grouping key) -> (layer ref, key, stacks, targets, sources), the least recently used first
        self.entries: dict[tuple[int, tuple], tuple] = {}
        self.lists: tuple[list, list] | None = None   # every entry's targets and sources, made when entries change
        self.slots: tuple | None = None   # their table for `copy_slots`' kernel, made with the lists
        self.stamp: int | None = None   # `casts_written` when every entry was last made current
        self.version = 0   # moves whenever an entry is kept or dropped (a captured step read the dropped one's)

    def find(self, layer: nn.Module, key: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
        where = (id(layer), key)
        entry = self.entries.get(where)
        if entry is None or entry[0]() is not layer:
            return None
        if next(reversed(self.entries)) != where:   # the most recently used last
            self.entries[where] = self.entries.pop(where)
        return entry[2]

    def keep(self, layer: nn.Module, key: tuple, stacks: tuple[torch.Tensor, torch.Tensor], targets: list,
             sources: list) -> None:
        """Keep `layer`'s stacks of grouping `key` (made current now), beside its other groupings' (the least
        recently used dropped past `GROUPINGS`), until the layer is gone."""
        ident = id(layer)
        self.entries.pop((ident, key), None)
        self.entries[(ident, key)] = (weakref.ref(layer, lambda _: self._drop(ident)), key, stacks, targets, sources)
        mine = [where for where in self.entries if where[0] == ident]
        for where in mine[:max(len(mine) - GROUPINGS, 0)]:
            del self.entries[where]
        self.lists = None
        self.version += 1
        device = stacks[0].device
        if triton_runs(device):   # the copy kernel's check now, in the step that first stacks, not the next one
            CHECK.works(device)

    def _drop(self, ident: int) -> None:
        dead = [where for where, entry in self.entries.items() if where[0] == ident and entry[0]() is None]
        for where in dead:
            del self.entries[where]
        if dead:
            self.lists = None
            self.version += 1

    def refresh(self) -> None:
        """Every kept stack made current from the jobs' copies, where any copy was written since the last time."""
        written = casts_written()
        if self.stamp == written:
            return
        if self.lists is None:
            self.lists = ([t for entry in self.entries.values() for t in entry[3]],
                          [s for entry in self.entries.values() for s in entry[4]])
            forget_slots(self.slots)
            self.slots = copy_slots(*self.lists) if self.lists[0] and len(
                {t.device for t in self.lists[0]}) == 1 else None
        if self.slots is not None:
            launch_slots(self.slots)
        elif self.lists[0]:
            with torch.no_grad():
                torch._foreach_copy_(*self.lists)
        self.stamp = written

    def forget(self, layer: nn.Module) -> None:
        mine = [where for where in self.entries if where[0] == id(layer)]
        for where in mine:
            del self.entries[where]
        if mine:
            self.lists = None
            self.version += 1

    def stale(self) -> None:
        """The next `refresh` copies, whether or not a copy was written since (a step captured as a graph: its
        replays must hold the copy, lora_masters.every_refresh)."""
        self.stamp = None



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
    tensors = layout.tensors
    key = ("lora-stack", id(layer), dtype, tuple(map(id, members)), casts_written() if pooled else tuple(
        [member.master_pool[0].generation if member.master_pool else (member.lora_A._version, member.lora_B._version)
         for member in members if member is not None]))
    if key in tensors:
        return tensors[key]
    present = [member for member in members if member is not None]
    ranks = {member.r for member in present}
    uniform = len(ranks) == 1 and next(iter(ranks)) % RANK_ALIGNMENT == 0
    if pooled and uniform and KEEP:
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
        if pooled and KEEP:
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
