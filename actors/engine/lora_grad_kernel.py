"""The grouped LoRA gradients of a backward's layers added into every job's pooled gradient buffer by one Triton kernel
launch at the backward's end.

On the CUDA path with `torch._grouped_mm` (actors/engine/lora_cuda.py), a layer's weight gradients come out stacked,
one group per job: (groups, rank, in) for A, (groups, out, rank) for B before the jobs' scalings, in bfloat16 (layers
sharing an input stack theirs together: actors/engine/lora_siblings.py, a `Block` each). Each job's share belongs in
its own float32 buffer (`lora_masters.MasterPool`). Done with torch operations, that is three passes over every
gradient: a cast to float32 (B: times the job's scaling), then a multi-tensor add into the buffers' views; on the 8B
shape at 32 adapters they were 11 ms of a 0.24 s step (bench/gpu_cost_model.py --fusion). Here the kernel reads each
group's bfloat16 gradient once, scales it (B), and adds it into that group's job buffer, every buffer reached
through a table of addresses (one per group; 0 for a group of no adapter, which is skipped), as Triton's grouped GEMM
tutorial reaches its groups' matrices, and every source through a table too: a layer's backward queues its stacks
(`GroupTargets.add`) and the backward's end adds them all in one launch (`flush`, an autograd engine callback), not
one launch a layer: on the host-bound H200 step of 2026-12-04 a launch cost the host ~75 µs, and the 8B step had
128 of them. The stacks wait in memory until then (about 2 bytes an adapter parameter a job, more where siblings'
block-diagonal B stacks hold zeros: ~0.5 GB on the 8B shape at r=16 and 4 jobs, while the backward frees the
activations); past `FLUSH_BYTES` they are added at once (so 2 launches a step there, and at most 256 MiB held). A launch
never holds two entries adding into one buffer (a layer computed twice in a step: its second entry waits for the
next launch). The arithmetic is the torch way's, operation for operation (a float32 product, then a float32 sum),
except that a compiler may contract the two into one rounding.

`add_groups_reference` is the same in torch, readable, for a device without Triton or where the kernel failed its
once-a-device check (`kernel_works`), and for the tests (tests/unit/engine/test_lora_grad_kernel.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from actors.engine.lora_masters import attach_pools
from actors.engine.triton_support import KernelCheck, tl, triton, triton_runs

BLOCK = 2048
INT32_LIMIT = 2 ** 31   # a block's elements, and its reach in a group's stack, kept under this (32-bit offsets)
FLUSH_BYTES = 256 * 2 ** 20   # stacked gradients queued past this are added at once
QUEUE = "lora-grad-queue"


def add_groups_reference(source: torch.Tensor, views: Sequence[torch.Tensor | None], scalings: torch.Tensor | None
                         ) -> None:
    """views[g] += float32(source[g]) (times scalings[g]) for every group g with a view."""
    with torch.no_grad():
        for group, view in enumerate(views):
            if view is None:
                continue
            value = source[group].float()
            if scalings is not None:
                value = value * scalings[group].reshape(())
            view.add_(value)


if triton is not None:
    @triton.jit
    def _add_groups_kernel(targets, meta, groups, BLOCK_SIZE: tl.constexpr):
        # program (group, slot, block). A slot is one layer's A rows or B block in its stack: `meta` holds per slot
        # (in elements) its source stack's address, its scalings' address (B: each group's scaling; A: 0), the block's
        # start in a group's stack, its size, the length of its rows, the distance between its rows, the distance
        # between groups; `targets` per slot and group the float32 buffer it adds into (0: none). A program past a
        # shorter block's end, or of a group with no buffer, does nothing; offsets inside a block are 32-bit (the host
        # keeps blocks under 2**31 elements: `INT32_LIMIT`), a block of adjacent rows is read without dividing
        group = tl.program_id(0)
        slot = tl.program_id(1).to(tl.int64)
        address = tl.load(targets + slot * groups + group)
        row = meta + slot * 7
        numel = tl.load(row + 3).to(tl.int32)
        begin = tl.program_id(2) * BLOCK_SIZE
        if address != 0:
            if begin < numel:
                start = tl.load(row + 2)
                width = tl.load(row + 4).to(tl.int32)
                stride = tl.load(row + 5).to(tl.int32)
                step = tl.load(row + 6)
                source = tl.load(row).to(tl.pointer_type(tl.bfloat16)) + (group.to(tl.int64) * step + start)
                offsets = begin + tl.arange(0, BLOCK_SIZE)
                inside = offsets < numel
                if width == stride:
                    value = tl.load(source + offsets, mask=inside, other=0.0).to(tl.float32)
                else:
                    value = tl.load(source + (offsets // width) * stride + offsets % width, mask=inside,
                                    other=0.0).to(tl.float32)
                scaling_at = tl.load(row + 1)
                if scaling_at != 0:
                    value = value * tl.load(scaling_at.to(tl.pointer_type(tl.float32)) + group)
                target = address.to(tl.pointer_type(tl.float32))
                tl.store(target + offsets, tl.load(target + offsets, mask=inside, other=0.0) + value, mask=inside)

    def _traffic(args: tuple, kwargs: dict) -> float:
        """Bytes the kernel moves (for bench/gpu_cost_model.py: its sources and targets are reached through tables,
        not arguments): every block's gradients read in bfloat16, their float32 targets read and written."""
        return _TABLE_BYTES.get(id(args[1]), 0.0)

    _add_groups_kernel.traffic = _traffic


def kernel_runs(device: torch.device) -> bool:
    """Whether the kernel runs on this device: Triton on CUDA, or its interpreter on a CPU (tests)."""
    return triton_runs(device)


def kernel_works(device: torch.device) -> bool:
    """Whether the kernel runs here and agrees with `add_groups_reference` on a small stack, checked once per device
    (`CHECK`): a kernel that fails or disagrees is logged once and the layers add their gradients the torch way."""
    return kernel_runs(device) and CHECK.works(device)


def _agrees(device: torch.device) -> bool:
    """Two layers' blocks (ranks 2 and 3 of a (3, 5, 400) A stack; outputs 5 and 7 of a (3, 12, 5) B stack, as
    layers sharing an input stack them) over three groups, the middle one of no adapter, added into float32
    buffers in one launch, the Bs scaled, by the kernel and by the reference: each within one float32 rounding of
    the other per operation, the gap untouched."""
    generator = torch.Generator().manual_seed(0)
    grad_a = torch.randn(3, 5, 400, generator=generator).to(device=device, dtype=torch.bfloat16)
    grad_b = torch.randn(3, 12, 5, generator=generator).to(device=device, dtype=torch.bfloat16)
    scalings = torch.tensor([2.0, 0.0, 0.375], device=device).view(3, 1, 1)
    blocks = [Block(0, 2, 0, 5), Block(2, 3, 5, 7)]
    starts = [torch.randn(3, *shape, generator=generator).to(device)
              for shape in ((2, 400), (5, 2), (3, 400), (7, 3))]
    results = []
    for kernel in (True, False):
        buffers = [start.clone() for start in starts]
        views = [([buffers[0][0], None, buffers[0][2]], [buffers[1][0], None, buffers[1][2]]),
                 ([buffers[2][0], None, buffers[2][2]], [buffers[3][0], None, buffers[3][2]])]
        targets = GroupTargets([], blocks, views, grad_a.shape, grad_b.shape, device, kernel)
        targets.add(grad_a, grad_b, scalings, {})
        results.append(buffers)
    eps = torch.finfo(torch.float32).eps
    sources = [grad_a[:, :2], grad_b[:, :5, :2], grad_a[:, 2:], grad_b[:, 5:, 2:]]
    return all(bool(((mine - theirs).abs() <= 4 * eps * (theirs.abs() + source.float().abs() * 2.0)).all())
               and bool((mine[1] == start[1]).all())
               for mine, theirs, source, start in zip(results[0], results[1], sources, starts, strict=True))


CHECK = KernelCheck("the grouped-gradient kernel", "gradients are added by torch operations", _agrees)
_TABLE_BYTES: dict[int, float] = {}   # id(a launch's meta table) -> bytes it moves (the cost model's, while launching)


@dataclass(frozen=True)
class Block:
    """One layer's place in a pair of stacked gradients: its A rows `rank_start` .. + `rank` of the As' stack
    (groups, ranks, in), and its B block, rows `out_start` .. + `out` and columns `rank_start` .. + `rank`, of the
    Bs' stack (groups, outs, ranks). A layer alone: the whole of both stacks."""
    rank_start: int
    rank: int
    out_start: int
    out: int


class GroupTargets:
    """Where grouped gradients go: for each layer's `Block` in the stacks, each group's A and B view of its job's
    gradient buffer (None for a group of no adapter), their slots for the kernel (addresses and shapes, made once and
    kept with the layers' adapters: the buffers never move), and the pools to attach before anything adds into them."""

    def __init__(self, pools: list, blocks: Sequence[Block], views: Sequence[tuple[Sequence, Sequence]],
                 a_shape: Sequence[int], b_shape: Sequence[int], device: torch.device, kernel: bool):
        self.pools, self.blocks, self.views, self.kernel = pools, list(blocks), list(views), kernel
        _, ranks, in_features = a_shape
        outs = b_shape[1]
        # per slot: (each group's target address, (start, elements, row length, row distance, group distance), a B)
        self.slots: list[tuple[list[int], tuple[int, int, int, int, int], bool]] = []
        for block, (a_views, b_views) in zip(self.blocks, self.views, strict=True):
            rows = block.rank * in_features
            self.slots.append(([0 if view is None else view.data_ptr() for view in a_views],
                               (block.rank_start * in_features, rows, rows, rows, ranks * in_features), False))
            self.slots.append(([0 if view is None else view.data_ptr() for view in b_views],
                               (block.out_start * ranks + block.rank_start, block.out * block.rank, block.rank, ranks,
                                outs * ranks), True))
        if any(shape[1] >= INT32_LIMIT or (shape[1] // max(shape[2], 1)) * shape[3] >= INT32_LIMIT
               for _, shape, _ in self.slots):
            self.kernel = False   # (no LoRA layer comes near: the kernel's offsets inside a block are 32-bit)
        self.addresses = frozenset(address for own, _, _ in self.slots for address in own if address)
        self.moved = sum(shape[1] * 10.0 for own, shape, _ in self.slots for address in own if address)

    @staticmethod
    def views_of(adapters: Sequence[nn.Module], member_of: Sequence[int | None]) -> tuple[list, list]:
        """Each group's (A views, B views) of its adapter's job buffer, None for a group of no adapter."""
        found = [None if index is None else adapters[index].master_pool[0].grads.views_of(adapters[index])
                 for index in member_of]
        return [None if pair is None else pair[0] for pair in found], [None if pair is None else pair[1]
                                                                       for pair in found]

    @classmethod
    def of(cls, adapters: Sequence[nn.Module], member_of: Sequence[int | None], rank: int,
           device: torch.device) -> GroupTargets | None:
        """The targets of one layer's grouped plan whose every adapter is pooled and of the stack's rank (no
        padding), else None (its gradients then go the torch way)."""
        if any(adapter.master_pool is None or adapter.r != rank for adapter in adapters):
            return None
        pools = {id(adapter.master_pool[0]): adapter.master_pool[0] for adapter in adapters}
        in_features, out_features = adapters[0].lora_A.shape[1], adapters[0].lora_B.shape[0]
        groups = len(member_of)
        return cls(list(pools.values()), [Block(0, rank, 0, out_features)], [cls.views_of(adapters, member_of)],
                   (groups, rank, in_features), (groups, out_features, rank), device, kernel_works(device))

    def add(self, grad_a: torch.Tensor, grad_b: torch.Tensor, scalings: torch.Tensor, tensors: dict) -> None:
        """grad_a (groups, ranks, in) and grad_b (groups, outs, ranks, before the scalings (groups, 1, 1)) to be added
        into the groups' buffers: queued until the backward's end (`flush`, once a backward), at once outside a
        backward or past `FLUSH_BYTES`."""
        queue = tensors.get(QUEUE)
        if queue is None:
            queue = tensors[QUEUE] = {"entries": [], "bytes": 0}
        queue["entries"].append((self, grad_a.contiguous(), grad_b.contiguous(), scalings))
        queue["bytes"] += grad_a.numel() * grad_a.element_size() + grad_b.numel() * grad_b.element_size()
        if torch._C._current_graph_task_id() == -1 or queue["bytes"] > FLUSH_BYTES:
            flush(tensors)
        elif len(queue["entries"]) == 1:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: flush(tensors))


def flush(tensors: dict) -> None:
    """Add every queued layer's stacked gradients into the jobs' buffers (the pools' gradients attached first, once a
    step): the kernel's in as few launches as keep each buffer to one entry a launch, the others the torch way."""
    queue = tensors.get(QUEUE)
    if not queue or not queue["entries"]:
        return
    entries, queue["entries"], queue["bytes"] = queue["entries"], [], 0
    attach_pools(list({id(pool): pool for entry in entries for pool in entry[0].pools}.values()), tensors)
    batch: list[tuple] = []
    covered: set[int] = set()
    for entry in entries:
        targets, grad_a, grad_b, scalings = entry
        if not targets.kernel:
            for block, (a_views, b_views) in zip(targets.blocks, targets.views, strict=True):
                rows = slice(block.rank_start, block.rank_start + block.rank)
                add_groups_reference(grad_a[:, rows], a_views, None)
                add_groups_reference(grad_b[:, block.out_start:block.out_start + block.out, rows], b_views,
                                     scalings)
            continue
        if covered & targets.addresses:   # a buffer this launch adds into already: the next launch takes it
            launch(batch, tensors)
            batch, covered = [], set()
        batch.append(entry)
        covered |= targets.addresses
    if batch:
        launch(batch, tensors)


def launch(entries: Sequence[tuple], tensors: dict) -> None:
    """One launch for the queued entries (GroupTargets, A stack, B stack, scalings): their slots' tables made on the
    host, copied once without waiting (from pinned memory on CUDA, kept referenced for the step: `tensors`)."""
    groups = max(grad_a.shape[0] for _, grad_a, _, _ in entries)
    addresses: list[list[int]] = []
    meta: list[tuple[int, ...]] = []
    for targets, grad_a, grad_b, scalings in entries:
        for own, shape, second in targets.slots:
            addresses.append(own + [0] * (groups - len(own)))
            meta.append(((grad_b if second else grad_a).data_ptr(), scalings.data_ptr() if second else 0, *shape))
    device = entries[0][1].device
    host = (torch.tensor(addresses, dtype=torch.int64), torch.tensor(meta, dtype=torch.int64))
    if device.type == "cuda":
        host = tuple(tensor.pin_memory() for tensor in host)
        tensors.setdefault("lora-grad-tables", []).append(host)
    table, rows = (tensor.to(device, non_blocking=True) for tensor in host)
    _TABLE_BYTES[id(rows)] = sum(entry[0].moved for entry in entries)
    try:
        _add_groups_kernel[(groups, len(meta), triton.cdiv(max(row[3] for row in meta), BLOCK))](
            table, rows, groups, BLOCK_SIZE=BLOCK)
    finally:
        _TABLE_BYTES.pop(id(rows), None)
