"""The CUDA LoRA path: each plain adapter of a layer on its own job's contiguous token segment, in the base's
compute dtype (bfloat16 on tensor cores), from float32 master weights cast once a step.

A fused step's tokens are grouped by job, so a job's tokens are one row range of the layer's input: its adapter
reads that range as a view (no gather, no padding) and adds its update into the same rows of the base output
in place (the GEMM's accumulate; the scaling folded into the cast copy of B). The layer's base product and every
adapter's update are one autograd function (`_LinearWithAdapters`), whose backward computes the input gradient
once (the base's `g W` with each job's `(g B) A` accumulated into its own rows) and each adapter's gradients
from its own rows only, so a NaN or inf in one job's tokens never reaches another job's weights.

Two kernels, the same arithmetic per job:
- `segments`: per job, one product for the down projection and one accumulating product for the update
  (forward); four in the backward. Launches grow with the number of jobs.
- `grouped_mm`: `torch._grouped_mm` over the jagged segments (offsets = the segments' ends): every job's down
  projection in one launch, every update in one more, the backward in four, whatever the number of jobs. The
  base product is then accumulated into that update by the base GEMM itself (`addmm_`, its epilogue reading the
  update), and in the backward `g W` into the jobs' `(g sB) A`: no separate pass adding a (tokens, features)
  tensor to another (on the 8B shape ~15 ms of a 0.23 s step by bench/gpu_cost_model.py).
  Ranks are padded to a multiple of 8 with zero rows (the kernel's 16-byte alignment); tokens of no plain
  adapter (another kind's job, a job not adapting this layer, compile padding) form groups of zero weights.
  bfloat16 only, no dropout (a job with dropout takes `segments` for the layer).
Layers that read one input (q, k and v; gate and up) take grouped_mm together on CUDA, in one autograd function of
their own (actors/engine/lora_siblings.py: fewer launches on a host-bound step).
`auto` picks `grouped_mm` on CUDA for bfloat16 adapters without dropout (one alone too: its base GEMM accumulates
into its update, and it rounds as it does fused) where the kernel passed its self-check on this device
(`grouped_mm_works`: it is compared once against exact products; an error or a mismatch logs why and keeps
`segments`); adapters with dropout take `segments` beside them. `bench/gpu_cost_model.py` ranks the two on a
modelled GPU.

Dropout masks come from each job's own generator (`LoraAdapter.dropout_generator`), drawn in the compute dtype
and kept (one byte-sized mask per element would need a kernel of its own; the compute dtype's is what PEFT keeps
too); under recomputation the generator states are replayed (actors/engine/recompute.py).

Master weights stay float32 (`LoraAdapter.lora_A`, `lora_B`, their optimizer state too); their compute-dtype
copies are made once a step, a job's whole adapter in one cast (its weights are views of one flat tensor:
`adapter_surgery.pool_masters`), kept between steps (actors/engine/lora_masters.py); the gradients come back in
float32, a pooled job's added into its gradient buffer (`MasterPool`, one multi-tensor add per layer; with grouped_mm
and every adapter of the stack's rank, one Triton kernel per weight adds the stacked bfloat16 gradients straight into
the jobs' buffers: actors/engine/lora_grad_kernel.py), where the job's optimizer step reads them
(actors/engine/flat_adamw.py).
The CPU keeps the float32 path of actors/engine/fused_linear.py (bit for bit fused == solo); this path runs on a CPU
only when `COMPUTE = "base"` asks for it (its tests compare it there with the float32 path within a bound
derived from bfloat16's rounding)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine import lora_grouped_mm, rank_products, weight_grad_products
from actors.engine.lora_grad_kernel import GroupTargets
from actors.engine.lora_grouped_mm import grouped_fits, grouped_mm_works
from actors.engine.lora_layer_state import layer_adapters
from actors.engine.lora_masters import GradientSink
from actors.engine.lora_stacks import stacked_weights

# "auto": this path on CUDA for a bfloat16 or float32 base; "base": on any device (tests, benchmarks);
# "float32": never (actors/engine/lora_adapter.py's float32 adapters everywhere)
COMPUTE: Literal["auto", "base", "float32"] = "auto"
# "auto": grouped_mm where it works and pays (module docstring); or one of the two forced
KERNEL: Literal["auto", "grouped_mm", "segments"] = "auto"
DTYPES = (torch.bfloat16, torch.float32)


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether plain adapters on a base of this device and dtype take this path (`COMPUTE`)."""
    if COMPUTE == "float32" or dtype not in DTYPES:
        return False
    return COMPUTE == "base" or device.type == "cuda"


def takes(adapters: Sequence[nn.Module], x: torch.Tensor, masters_float32: bool | None = None) -> bool:
    """Whether these plain adapters' updates on input `x` take this path. `masters_float32`: whether every one's
    A is float32, where the caller knows it (checked here otherwise)."""
    if COMPUTE == "float32" or not adapters or x.dtype not in DTYPES:
        return False
    if COMPUTE == "auto" and not x.is_cuda:
        return False
    if masters_float32 is not None:
        return masters_float32
    return all([adapter.lora_A.dtype == torch.float32 for adapter in adapters])


@dataclass(frozen=True)
class _Segment:
    start: int
    end: int
    scaling: float
    keep: float   # dropout's keep probability; 1.0: no dropout

    @property
    def tokens(self) -> int:
        return self.end - self.start


# -- the autograd function ----------------------------------------------------------------------------------

class _LinearWithAdapters(torch.autograd.Function):
    """y = x W^T + b, then y[s:e] += scaling_j * dropout_j(x[s:e]) A_j^T B_j^T for each job j in place.
    `plans`: the adapters by kernel (`_Plan`). Their float32 gradients (2 per adapter, in the plans' order) go
    two ways: a pooled job's (`GradientSink`) are added into its pool's gradient buffer, every layer's in one
    multi-tensor operation, with no autograd node per parameter; another adapter's A and B are inputs after the
    fixed ones and get theirs from autograd. `anchor`: a leaf that needs a gradient, so that the backward runs
    where neither `x` nor any input does (the first adapted layer, all its adapters pooled)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                base_out: torch.Tensor | None, plans: tuple[_Plan, ...], sink: GradientSink | None,
                anchor: torch.Tensor | None, *masters: torch.Tensor) -> torch.Tensor:
        saved: list[torch.Tensor] = []
        counts: list[int] = []
        rest = plans
        if base_out is None and plans and plans[0].kernel == "grouped_mm":
            # the grouped update first, the base product accumulated into it by the GEMM itself (its epilogue
            # reads it once): no separate pass adding a (tokens, out) update to the output
            hidden, out = plans[0].grouped_update(x)
            if bias is not None:
                out.add_(bias)
            out.addmm_(x, weight.t())
            saved.append(hidden)
            counts.append(1)
            rest = plans[1:]
        else:
            out = F.linear(x, weight, bias) if base_out is None else base_out
        for plan in rest:
            own = plan.forward(x, out)
            saved.extend(own)
            counts.append(len(own))
        ctx.plans = plans
        ctx.counts = counts
        ctx.sink = sink
        ctx.has_weight = weight is not None
        ctx.save_for_backward(x, weight if weight is not None else _EMPTY, *saved)
        if base_out is not None:
            ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, *saved = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        plans = ctx.plans
        early: tuple[torch.Tensor, torch.Tensor] | None = None   # the first grouped plan's (grad_out, grad_hidden)
        if ctx.needs_input_grad[0] and ctx.has_weight and plans and plans[0].kernel == "grouped_mm":
            # as in the forward: the grouped input gradient first, the base's `g W` accumulated into it
            early = plans[0].grouped_grad_hidden(grad_out)
            grad_x = plans[0].grouped_input_grad(early[1])
            grad_x.addmm_(grad_out, weight)
        elif ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight if ctx.has_weight else torch.zeros_like(x)
        grads: list[torch.Tensor] = []
        position = 0
        for index, (plan, count) in enumerate(zip(plans, ctx.counts, strict=True)):
            own = saved[position:position + count]
            if index == 0 and early is not None:
                grads.extend(plan.grouped_weight_grads(early[0], x, own[0], early[1]))
            else:
                grads.extend(plan.backward(grad_out, x, grad_x, own))
            position += count
        sink = ctx.sink
        if sink is not None:
            grads = sink.add(grads)
        # x, weight, bias, base_out, plans, sink, anchor, then the masters
        return (grad_x, None, None, grad_out if not ctx.has_weight else None, None, None, None, *grads)


_EMPTY = torch.empty(0)
_ANCHORS: dict[torch.device, torch.Tensor] = {}


def anchor_of(device: torch.device) -> torch.Tensor:
    """One empty leaf per device that needs a gradient (`_LinearWithAdapters`' anchor); it never gets one."""
    anchor = _ANCHORS.get(device)
    if anchor is None:
        anchor = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return anchor


class _Plan:
    """What one layer's adapters compute this call: their segments, copies and kernel."""

    def __init__(self, adapters: list[nn.Module], segments: list[_Segment], copies, kernel: str,
                 groups: list[int] | None = None, offsets: torch.Tensor | None = None,
                 scalings: torch.Tensor | None = None, targets: GroupTargets | None = None,
                 tensors: dict | None = None):
        self.adapters = adapters
        self.segments = segments
        self.copies = copies          # segments: [(A, sB)] per adapter; grouped: (A stack, sB stack)
        self.kernel = kernel
        self.groups = groups          # grouped: the group index of each adapter
        self.offsets = offsets        # grouped: int32 ends of the groups on the device
        self.scalings = scalings      # grouped: (groups, 1, 1) float32 scalings on the device (0: no adapter)
        self.targets = targets        # grouped: where the stacked gradients are added (then none are returned)
        self.tensors = tensors        # the step's (with `targets`)

    # segments ---------------------------------------------------------------------------------------------
    def _dropout_masks(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        masks: list[torch.Tensor | None] = []
        for adapter, segment in zip(self.adapters, self.segments, strict=True):
            if segment.keep < 1.0:
                mask = torch.empty(segment.tokens, x.shape[-1], dtype=x.dtype, device=x.device)
                masks.append(mask.bernoulli_(segment.keep, generator=adapter.dropout_generator))
            else:
                masks.append(None)
        return masks

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        if self.kernel == "grouped_mm":
            hidden, update = self.grouped_update(x)
            out.add_(update)
            return [hidden]
        masks = self._dropout_masks(x)
        saved: list[torch.Tensor] = []
        for (lora_a, lora_b), segment, mask in zip(self.copies, self.segments, masks, strict=True):
            rows = x[segment.start:segment.end]
            if mask is not None:
                rows = rows * mask
            hidden = rows @ lora_a.t()                                                         # (n, r)
            out[segment.start:segment.end].addmm_(hidden, lora_b.t(), alpha=1.0 / segment.keep)
            saved.append(hidden)
            if mask is not None:
                saved.append(mask)
        return saved

    def backward(self, grad_out: torch.Tensor, x: torch.Tensor, grad_x: torch.Tensor | None,
                 saved: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.kernel == "grouped_mm":
            return self._grouped_backward(grad_out, x, grad_x, saved[0])
        grads: list[torch.Tensor] = []
        position = 0
        for (lora_a, lora_b), segment in zip(self.copies, self.segments, strict=True):
            hidden = saved[position]
            position += 1
            mask = None
            if segment.keep < 1.0:
                mask = saved[position]
                position += 1
            rows_grad = grad_out[segment.start:segment.end]
            rows = x[segment.start:segment.end]
            if mask is not None:
                rows = rows * mask
            inverse_keep = 1.0 / segment.keep
            grad_hidden = rows_grad @ lora_b                                                   # (n, r), scaled
            grad_a = (grad_hidden.t() @ rows).float()
            if inverse_keep != 1.0:
                grad_a.mul_(inverse_keep)
            grad_b = (rows_grad.t() @ hidden).float().mul_(segment.scaling * inverse_keep)
            if grad_x is not None:
                if mask is None:
                    grad_x[segment.start:segment.end].addmm_(grad_hidden, lora_a, alpha=inverse_keep)
                else:
                    grad_x[segment.start:segment.end].add_((grad_hidden @ lora_a) * mask, alpha=inverse_keep)
            grads.extend((grad_a, grad_b))
        return grads

    # grouped_mm -------------------------------------------------------------------------------------------
    def grouped_update(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the down projection (T, rank), every job's update on its own rows (T, out); zeros on a gap group's)."""
        a_stack, b_stack = self.copies
        hidden = rank_products.down(x, a_stack, self.offsets)                                 # (T, rank)
        return hidden, torch._grouped_mm(hidden, b_stack.mT, offs=self.offsets)

    def grouped_grad_hidden(self, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(grad_out as the kernel takes it: 16-byte aligned, the gradient of the down projection (T, rank))."""
        if grad_out.data_ptr() % 16:   # a view into a larger gradient: the kernel needs 16-byte aligned operands
            grad_out = grad_out.clone()
        return grad_out, rank_products.grad_hidden(grad_out, self.copies[1], self.offsets)

    def grouped_input_grad(self, grad_hidden: torch.Tensor) -> torch.Tensor:
        """Every job's (g sB) A on its own rows: (T, in)."""
        return torch._grouped_mm(grad_hidden, self.copies[0], offs=self.offsets)

    def _grouped_backward(self, grad_out: torch.Tensor, x: torch.Tensor, grad_x: torch.Tensor | None,
                          hidden: torch.Tensor) -> list[torch.Tensor]:
        grad_out, grad_hidden = self.grouped_grad_hidden(grad_out)
        if grad_x is not None:
            grad_x.add_(self.grouped_input_grad(grad_hidden))
        return self.grouped_weight_grads(grad_out, x, hidden, grad_hidden)

    def grouped_weight_grads(self, grad_out: torch.Tensor, x: torch.Tensor, hidden: torch.Tensor,
                             grad_hidden: torch.Tensor) -> list[torch.Tensor]:
        """Each adapter's float32 (grad A, grad B), from its own rows only; with `targets`, added straight into the
        jobs' gradient buffers (actors/engine/lora_grad_kernel.py) and none returned."""
        if self.targets is not None:
            self.targets.add(weight_grad_products.sums(grad_hidden, x, self.offsets),
                             weight_grad_products.sums(grad_out, hidden, self.offsets), self.scalings, self.tensors)
            return []
        grad_a = weight_grad_products.sums(grad_hidden, x, self.offsets).float()             # (groups, rank, in)
        # (groups, out, rank), times each group's scaling into float32 in one kernel
        grad_b = torch.mul(weight_grad_products.sums(grad_out, hidden, self.offsets), self.scalings)
        rows_a, rows_b = grad_a.unbind(0), grad_b.unbind(0)   # every group's gradient in two calls, not 2 per job
        grads: list[torch.Tensor] = []
        rank = grad_a.shape[1]
        for adapter, group in zip(self.adapters, self.groups, strict=True):
            if adapter.r == rank:
                grads.extend((rows_a[group], rows_b[group]))
            else:   # a rank padded to the kernel's alignment: its own rows and columns
                grads.extend((rows_a[group][:adapter.r], rows_b[group][:, :adapter.r]))
        return grads


# -- choosing the kernel ------------------------------------------------------------------------------------

def grouped_pays(segments: list[_Segment], x: torch.Tensor, base: nn.Module) -> bool:
    """`auto`'s choice for a layer's adapters without dropout: grouped_mm on CUDA in bfloat16, where the kernel
    works, for one adapter too (its base GEMM then accumulates into the update: no separate addition; and a job
    alone rounds as it does fused)."""
    if not grouped_fits(x, base):
        return False
    if KERNEL != "auto":
        return KERNEL == "grouped_mm"
    return x.is_cuda and len(segments) >= 1 and grouped_mm_works(x.device)


def linear_with_adapters(base: nn.Module, full_precision: bool, x: torch.Tensor, adapters: list[nn.Module],
                         bounds: list[tuple[int, int]], layout: object) -> torch.Tensor:
    """The base layer's output on `x` (tokens, in) with each adapter's update added on its own rows `bounds`.
    `full_precision`: the base is a plain float linear layer whose product this function computes itself; else
    (a quantized layer) the base runs as it is and the updates are added to its output in place. The adapters
    with dropout take the per-segment kernel, the others grouped_mm where it pays (`grouped_pays`): which kernel
    a job takes never depends on the other jobs' settings (so its rounding does not either)."""
    dtype = x.dtype
    entry = layer_adapters(base, adapters)
    structure = structure_of(layout, adapters, bounds, x, base, entry.signature)
    copies = entry.weights(layout, dtype)
    order = tuple([tuple(indices) for indices, *_ in structure])
    taking = entry.takes_gradients()
    plans: list[_Plan] = []
    for indices, kernel, segments, grouping in structure:
        chosen = [adapters[index] for index in indices]
        if kernel == "grouped_mm":
            member_of, groups, offsets, scalings = grouping
            members, weights = entry.members(dtype, indices, member_of, copies)
            stacks = stacked_weights(layout, base, members, dtype, weights, pooled=not entry.unpooled)
            targets = entry.targets(order, chosen, member_of, stacks[0].shape[1], x.device) if (
                taking and not plans) else None
            plans.append(_Plan(chosen, segments, stacks, "grouped_mm", groups, offsets, scalings, targets,
                               layout.tensors))
        else:
            plans.append(_Plan(chosen, segments, [copies[index] for index in indices], "segments"))
    stacked = plans[0].targets is not None
    sink, masters = entry.route(order, layout, taking, stacked)
    anchor = anchor_of(x.device) if sink is not None or stacked else None
    if full_precision:
        return _LinearWithAdapters.apply(x, base.weight, base.bias, None, tuple(plans), sink, anchor, *masters)
    base_out = base(x)
    if base_out.dtype != dtype:
        base_out = base_out.to(dtype)
    return _LinearWithAdapters.apply(x, None, None, base_out, tuple(plans), sink, anchor, *masters)


def structure_of(layout: object, adapters: list[nn.Module], bounds: list[tuple[int, int]], x: torch.Tensor,
               base: nn.Module, signature: tuple) -> list[tuple[list[int], str, list[_Segment], tuple | None]]:
    """Which adapters take which kernel, their segments, and grouped_mm's groups: (indices, kernel, segments,
    (member of each group, each adapter's group, offsets, scalings) or None). The same for every layer that the
    same jobs adapt (their scalings, dropout and bounds are the job's), so made once a step for each such set.
    `signature`: each adapter's `lora_layer_state._job_of`."""
    tensors = layout.tensors
    aligned = grouped_fits(x, base)
    key = ("lora-structure", tuple(bounds), signature, x.dtype, aligned, x.shape[0])
    if key in tensors:
        return tensors[key]
    segments = [_Segment(start, end, adapter.scaling, 1.0 - adapter.dropout if adapter.drops else 1.0)
                for adapter, (start, end) in zip(adapters, bounds, strict=True)]
    plain = [index for index, segment in enumerate(segments) if segment.keep == 1.0]
    if plain and aligned and grouped_pays([segments[index] for index in plain], x, base):
        dropping = [index for index in range(len(adapters)) if index not in plain]
        split = [(plain, "grouped_mm")] + ([(dropping, "segments")] if dropping else [])
    else:
        split = [(list(range(len(adapters))), "segments")]
    structure = []
    for indices, kernel in split:
        chosen = [segments[index] for index in indices]
        grouping = None
        if kernel == "grouped_mm":
            grouping = lora_grouped_mm.grouping(layout, [adapters[index] for index in indices], chosen, x)
        structure.append((indices, kernel, chosen, grouping))
    tensors[key] = structure
    return structure
