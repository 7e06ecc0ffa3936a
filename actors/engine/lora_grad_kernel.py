"""A layer's grouped LoRA gradients added into every job's pooled gradient buffer by one Triton kernel launch.

On the CUDA path with `torch._grouped_mm` (actors/engine/lora_cuda.py), a layer's weight gradients come out stacked,
one group per job: (groups, rank, in) for A, (groups, out, rank) for B before the jobs' scalings, in bfloat16. Each
job's share belongs in its own float32 buffer (`lora_masters.MasterPool`). Done with torch operations, that is three
passes over every gradient: a cast to float32 (B: times the job's scaling), then a multi-tensor add into the buffers'
views (which runs at about half the card's bandwidth, and re-reads the float32 copy); on the 8B shape at 32 adapters
they were 11 ms of a 0.24 s step (bench/gpu_cost_model.py --fusion). Here one kernel launch per layer (its A and
its B stack: on the host-bound H200 step of 2026-12-04 a launch cost the host ~75 µs) reads each group's bfloat16
gradient once, scales it (B), and adds it into that group's job buffer: every job's buffer is reached through
a table of addresses (one per group; 0 for a group of no adapter, which is skipped), as Triton's grouped GEMM tutorial
reaches its groups' matrices. The arithmetic is the torch way's, operation for operation (a float32 product, then a
float32 sum), except that a compiler may contract the two into one rounding.

`add_groups_reference` is the same in torch, readable, for a device without Triton or where the kernel failed its
once-a-device check (`kernel_works`), and for the tests (tests/unit/engine/test_lora_grad_kernel.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from actors.engine.lora_masters import attach_pools
from actors.engine.triton_support import KernelCheck, tl, triton, triton_runs

BLOCK = 2048


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
    def _add_groups_kernel(source_a, source_b, targets_a, targets_b, scalings, numel_a, numel_b,
                           BLOCK_SIZE: tl.constexpr):
        # program (group, stack, block): stack 0 adds the As as they are, stack 1 the Bs times their group's scaling
        group = tl.program_id(0)
        second = tl.program_id(1) == 1
        source = source_a
        targets = targets_a
        numel = numel_a
        if second:
            source = source_b
            targets = targets_b
            numel = numel_b
        address = tl.load(targets + group)
        offsets = tl.program_id(2).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        if address != 0:   # (a program past the shorter stack's end masks all its entries)
            target = address.to(tl.pointer_type(tl.float32))
            inside = offsets < numel
            value = tl.load(source + group.to(tl.int64) * numel + offsets, mask=inside, other=0.0).to(tl.float32)
            if second:
                value = value * tl.load(scalings + group)
            tl.store(target + offsets, tl.load(target + offsets, mask=inside, other=0.0) + value, mask=inside)

    def _traffic(args: tuple, kwargs: dict) -> float:
        """Bytes the kernel moves (for bench/gpu_cost_model.py: its targets are reached through addresses, not
        arguments): every group's gradients read in bfloat16, their float32 targets read and written."""
        return float(sum(source.numel() * (source.element_size() + 8) for source in args[:2]))

    _add_groups_kernel.traffic = _traffic


def kernel_runs(device: torch.device) -> bool:
    """Whether the kernel runs on this device: Triton on CUDA, or its interpreter on a CPU (tests)."""
    return triton_runs(device)


def kernel_works(device: torch.device) -> bool:
    """Whether the kernel runs here and agrees with `add_groups_reference` on a small stack, checked once per device
    (`CHECK`): a kernel that fails or disagrees is logged once and the layers add their gradients the torch way."""
    return kernel_runs(device) and CHECK.works(device)


def _agrees(device: torch.device) -> bool:
    """Three groups (the middle one of no adapter) of a (3, 2, 400) A stack and a (3, 5, 700) B stack added into
    float32 buffers in one launch, the Bs scaled, by the kernel and by the reference: each within one float32
    rounding of the other per operation, the gap untouched."""
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(3, *shape, generator=generator).to(device=device, dtype=torch.bfloat16)
               for shape in ((2, 400), (5, 700))]
    scalings = torch.tensor([2.0, 0.0, 0.375], device=device).view(3, 1, 1)
    starts = [torch.randn(source.shape, generator=generator).to(device) for source in sources]
    results = []
    for kernel in (True, False):
        buffers = [start.clone() for start in starts]
        views = [[buffer[0], None, buffer[2]] for buffer in buffers]
        if kernel:
            (table_a, _host_a), (table_b, _host_b) = _table(views[0], device), _table(views[1], device)
            launch(sources[0], sources[1], table_a, table_b, scalings)
        else:
            add_groups_reference(sources[0], views[0], None)
            add_groups_reference(sources[1], views[1], scalings)
        results.append(buffers)
    eps = torch.finfo(torch.float32).eps
    return all(bool(((mine - theirs).abs() <= 4 * eps * (theirs.abs() + source.float().abs() * 2.0)).all())
               and bool((mine[1] == start[1]).all())
               for mine, theirs, source, start in zip(results[0], results[1], sources, starts, strict=True))


CHECK = KernelCheck("the grouped-gradient kernel", "gradients are added by torch operations", _agrees)


def _table(views: Sequence[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the groups' target addresses on the device (0: no target), their host copy): copied once without waiting,
    from pinned memory on CUDA (the caller keeps the host copy referenced as long as the table)."""
    host = torch.tensor([0 if view is None else view.data_ptr() for view in views], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def launch(grad_a: torch.Tensor, grad_b: torch.Tensor, table_a: torch.Tensor, table_b: torch.Tensor,
           scalings: torch.Tensor) -> None:
    """One launch for a layer's two stacks (contiguous, one group per job): the As added as they are, the Bs
    times their group's scaling; the shorter stack's programs past its end touch nothing (every entry masked)."""
    numel_a, numel_b = grad_a[0].numel(), grad_b[0].numel()
    _add_groups_kernel[(grad_a.shape[0], 2, triton.cdiv(max(numel_a, numel_b), BLOCK))](
        grad_a, grad_b, table_a, table_b, scalings, numel_a, numel_b, BLOCK_SIZE=BLOCK)


class GroupTargets:
    """Where one layer's grouped gradients go: each group's A and B view of its job's gradient buffer (None for a
    group of no adapter), their address tables on the device (made once, kept with the layer's adapters: the
    buffers never move), and the pools to attach before the kernel adds into them."""

    def __init__(self, pools: list, a_views: list[torch.Tensor | None], b_views: list[torch.Tensor | None],
                 device: torch.device, kernel: bool):
        self.pools, self.a_views, self.b_views, self.kernel = pools, a_views, b_views, kernel
        # (device table, its pinned host copy) for the As and the Bs
        self.tables = (_table(a_views, device), _table(b_views, device)) if kernel else None

    @classmethod
    def of(cls, adapters: Sequence[nn.Module], member_of: Sequence[int | None], rank: int,
           device: torch.device) -> GroupTargets | None:
        """The targets of a grouped plan whose every adapter is pooled and of the stack's rank (no padding), else
        None (its gradients then go the torch way)."""
        if any(adapter.master_pool is None or adapter.r != rank for adapter in adapters):
            return None
        pools = {id(adapter.master_pool[0]): adapter.master_pool[0] for adapter in adapters}
        a_views: list[torch.Tensor | None] = []
        b_views: list[torch.Tensor | None] = []
        for index in member_of:
            if index is None:
                a_views.append(None)
                b_views.append(None)
                continue
            adapter = adapters[index]
            a_view, b_view = adapter.master_pool[0].grads.views_of(adapter)
            a_views.append(a_view)
            b_views.append(b_view)
        return cls(list(pools.values()), a_views, b_views, device, kernel_works(device))

    def add(self, grad_a: torch.Tensor, grad_b: torch.Tensor, scalings: torch.Tensor, tensors: dict) -> None:
        """grad_a (groups, rank, in) and grad_b (groups, out, rank, before the scalings) added into the groups'
        buffers, the pools' gradients attached first (once a step)."""
        attach_pools(self.pools, tensors)
        if self.tables is not None:
            launch(grad_a.contiguous(), grad_b.contiguous(), self.tables[0][0], self.tables[1][0], scalings)
        else:
            add_groups_reference(grad_a, self.a_views, None)
            add_groups_reference(grad_b, self.b_views, scalings)
