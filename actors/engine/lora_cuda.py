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
  projection in one launch, every update in one more, the backward in four, whatever the number of jobs.
  Ranks are padded to a multiple of 8 with zero rows (the kernel's 16-byte alignment); tokens of no plain
  adapter (another kind's job, a job not adapting this layer, compile padding) form groups of zero weights.
  bfloat16 only, no dropout (a job with dropout takes `segments` for the layer).
`auto` picks `grouped_mm` on CUDA for bfloat16 when at least two adapters without dropout share the layer and
the kernel passed its self-check on this device (`grouped_mm_works`: it is compared once against exact
products; an error or a mismatch logs why and keeps `segments`); adapters with dropout take `segments` beside
them. `bench/gpu_cost_model.py` ranks the two on a modelled GPU.

Dropout masks come from each job's own generator (`LoraAdapter.dropout_generator`), drawn in the compute dtype
and kept (one byte-sized mask per element would need a kernel of its own; the compute dtype's is what PEFT keeps
too); under recomputation the generator states are replayed (actors/engine/recompute.py).

Master weights stay float32 (`LoraAdapter.lora_A`, `lora_B`, their optimizer state too); their compute-dtype
copies are made once per step layout and weight version (`CastCache`), and the gradients come back in float32.
The CPU keeps the float32 path of actors/engine/lora.py (bit for bit fused == solo); this path runs on a CPU
only when `COMPUTE = "base"` asks for it (its tests compare it there with the float32 path within a bound
derived from bfloat16's rounding)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# "auto": this path on CUDA for a bfloat16 or float32 base; "base": on any device (tests, benchmarks);
# "float32": never (actors/engine/lora.py's float32 adapters everywhere)
COMPUTE: Literal["auto", "base", "float32"] = "auto"
# "auto": grouped_mm where it works and pays (module docstring); or one of the two forced
KERNEL: Literal["auto", "grouped_mm", "segments"] = "auto"
DTYPES = (torch.bfloat16, torch.float32)
RANK_ALIGNMENT = 8   # grouped_mm: 16-byte strides, 8 bfloat16 elements


def applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether plain adapters on a base of this device and dtype take this path (`COMPUTE`)."""
    if COMPUTE == "float32" or dtype not in DTYPES:
        return False
    return COMPUTE == "base" or device.type == "cuda"


def takes(adapters: Sequence[nn.Module], x: torch.Tensor) -> bool:
    """Whether these plain adapters' updates on input `x` take this path."""
    if COMPUTE == "float32" or not adapters or x.dtype not in DTYPES:
        return False
    if COMPUTE == "auto" and not x.is_cuda:
        return False
    return all(adapter.lora_A.dtype == torch.float32 for adapter in adapters)


@dataclass(frozen=True)
class _Segment:
    start: int
    end: int
    scaling: float
    keep: float   # dropout's keep probability; 1.0: no dropout

    @property
    def tokens(self) -> int:
        return self.end - self.start


class CastCache:
    """Compute-dtype copies of an adapter's A and scaling * B, made once per step: an entry holds the step's
    layout it was made under (a new step has a new layout object) and the weights' versions (an optimizer step
    or a load changes them in place), so a recomputed forward in the same step reuses it."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[object, tuple[int, ...], tuple[torch.Tensor, ...]]] = {}
        self.layout: object = None

    def get(self, key: tuple, owner: object, versions: tuple[int, ...], make) -> tuple[torch.Tensor, ...]:
        if owner is not self.layout:   # a new step: the last one's copies are dropped (memory stays one step's)
            self.entries.clear()
            self.layout = owner
        entry = self.entries.get(key)
        if entry is not None and entry[0] is owner and entry[1] == versions:
            return entry[2]
        tensors = make()
        self.entries[key] = (owner, versions, tensors)
        return tensors


def _versions(adapters: Sequence[nn.Module]) -> tuple[int, ...]:
    return tuple(v for a in adapters for v in (a.lora_A._version, a.lora_B._version))


def adapter_copies(cache: CastCache, layout: object, adapters: Sequence[nn.Module], dtype: torch.dtype
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per adapter (A (r, in), scaling * B (out, r)) in `dtype`."""
    def make() -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for adapter in adapters:
            out.append(adapter.lora_A.detach().to(dtype))
            out.append((adapter.lora_B.detach() * adapter.scaling).to(dtype))
        return tuple(out)

    key = ("segments", dtype, tuple(id(a) for a in adapters))
    flat = cache.get(key, layout, _versions(adapters), make)
    return [(flat[2 * i], flat[2 * i + 1]) for i in range(len(adapters))]


def padded_rank(adapters: Sequence[nn.Module]) -> int:
    longest = max(a.r for a in adapters)
    return -(-longest // RANK_ALIGNMENT) * RANK_ALIGNMENT


def stacked_copies(cache: CastCache, layout: object, adapters: Sequence[nn.Module | None], dtype: torch.dtype,
                   in_features: int, out_features: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A stacked (groups, rank, in), scaling * B stacked (groups, out, rank)) in `dtype`, ranks padded with zero
    rows to `padded_rank`; a group of None (tokens of no plain adapter) is all zeros."""
    present = [a for a in adapters if a is not None]

    def make() -> tuple[torch.Tensor, ...]:
        rank = padded_rank(present)
        a_stack = torch.zeros(len(adapters), rank, in_features, dtype=dtype, device=device)
        b_stack = torch.zeros(len(adapters), out_features, rank, dtype=dtype, device=device)
        for index, adapter in enumerate(adapters):
            if adapter is not None:
                a_stack[index, :adapter.r].copy_(adapter.lora_A.detach())
                b_stack[index, :, :adapter.r].copy_(adapter.lora_B.detach() * adapter.scaling)
        return a_stack, b_stack

    key = ("grouped", dtype, tuple(id(a) for a in adapters))
    a_stack, b_stack = cache.get(key, layout, _versions(present), make)
    return a_stack, b_stack


# -- the autograd function ----------------------------------------------------------------------------------

class _LinearWithAdapters(torch.autograd.Function):
    """y = x W^T + b, then y[s:e] += scaling_j * dropout_j(x[s:e]) A_j^T B_j^T for each job j in place.
    `plans`: the adapters by kernel (`_Plan`); inputs after the fixed ones: each plan's adapters' float32 A and B
    in order (their gradients come back in float32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                base_out: torch.Tensor | None, plans: tuple[_Plan, ...], *masters: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, weight, bias) if base_out is None else base_out
        saved: list[torch.Tensor] = []
        counts: list[int] = []
        for plan in plans:
            own = plan.forward(x, out)
            saved.extend(own)
            counts.append(len(own))
        ctx.plans = plans
        ctx.counts = counts
        ctx.has_weight = weight is not None
        ctx.save_for_backward(x, weight if weight is not None else x.new_empty(0), *saved)
        if base_out is not None:
            ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, *saved = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out @ weight if ctx.has_weight else torch.zeros_like(x)
        grads: list[torch.Tensor] = []
        position = 0
        for plan, count in zip(ctx.plans, ctx.counts, strict=True):
            grads.extend(plan.backward(grad_out, x, grad_x, saved[position:position + count]))
            position += count
        # x, weight, bias, base_out, plans, then the masters
        return (grad_x, None, None, grad_out if not ctx.has_weight else None, None, *grads)


class _Plan:
    """What one layer's adapters compute this call: their segments, copies and kernel."""

    def __init__(self, adapters: list[nn.Module], segments: list[_Segment], copies, kernel: str,
                 groups: list[int] | None = None, offsets: torch.Tensor | None = None,
                 scalings: torch.Tensor | None = None):
        self.adapters = adapters
        self.segments = segments
        self.copies = copies          # segments: [(A, sB)] per adapter; grouped: (A stack, sB stack)
        self.kernel = kernel
        self.groups = groups          # grouped: the group index of each adapter
        self.offsets = offsets        # grouped: int32 ends of the groups on the device
        self.scalings = scalings      # grouped: (groups, 1, 1) float32 scalings on the device (0: no adapter)

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
            a_stack, b_stack = self.copies
            hidden = torch._grouped_mm(x, a_stack.mT, offs=self.offsets)                    # (T, rank)
            out.add_(torch._grouped_mm(hidden, b_stack.mT, offs=self.offsets))
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
        for adapter, (lora_a, lora_b), segment in zip(self.adapters, self.copies, self.segments, strict=True):
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
            grad_b = (rows_grad.t() @ hidden).float()
            if inverse_keep != 1.0:
                grad_a.mul_(inverse_keep)
            grad_b.mul_(adapter.scaling * inverse_keep)
            if grad_x is not None:
                if mask is None:
                    grad_x[segment.start:segment.end].addmm_(grad_hidden, lora_a)
                else:
                    grad_x[segment.start:segment.end].add_((grad_hidden @ lora_a) * mask, alpha=inverse_keep)
            grads.extend((grad_a, grad_b))
        return grads

    def _grouped_backward(self, grad_out: torch.Tensor, x: torch.Tensor, grad_x: torch.Tensor | None,
                          hidden: torch.Tensor) -> list[torch.Tensor]:
        a_stack, b_stack = self.copies
        if grad_out.data_ptr() % 16:   # a view into a larger gradient: the kernel needs 16-byte aligned operands
            grad_out = grad_out.clone()
        grad_hidden = torch._grouped_mm(grad_out, b_stack, offs=self.offsets)                  # (T, rank)
        if grad_x is not None:
            grad_x.add_(torch._grouped_mm(grad_hidden, a_stack, offs=self.offsets))
        grad_a = torch._grouped_mm(grad_hidden.t(), x, offs=self.offsets).float()             # (groups, rank, in)
        # (groups, out, rank), times each group's scaling into float32 in one kernel
        grad_b = torch.mul(torch._grouped_mm(grad_out.t(), hidden, offs=self.offsets), self.scalings)
        grads: list[torch.Tensor] = []
        for adapter, group in zip(self.adapters, self.groups, strict=True):
            grads.append(grad_a[group, :adapter.r])
            grads.append(grad_b[group, :, :adapter.r])
        return grads


# -- choosing the kernel ------------------------------------------------------------------------------------

# None: `grouped_mm_works` checks the kernel once per device; True / False: taken as given (the cost model,
# which runs the step on fake tensors, and benchmarks that force a kernel)
GROUPED_MM_VERIFIED: bool | None = None
_GROUPED_CHECKED: dict[tuple[str, int | None], bool] = {}


def grouped_mm_works(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs here and agrees with per-segment products on a small problem (checked
    once per device): an error or a mismatch logs why and the layers take `segments`."""
    if GROUPED_MM_VERIFIED is not None:
        return GROUPED_MM_VERIFIED
    key = (device.type, device.index)
    if key not in _GROUPED_CHECKED:
        _GROUPED_CHECKED[key] = _check_grouped_mm(device)
    return _GROUPED_CHECKED[key]


def _check_grouped_mm(device: torch.device) -> bool:
    """The four forms the path calls (the down and up projections; the backward's jagged-K weight gradients,
    with transposed operands), on groups of 7, 0 and 33 rows, against float64 products of the same bfloat16
    numbers: each entry within one bfloat16 rounding plus the float32 accumulation of its sum, relative to the
    sum of its terms' magnitudes."""
    if not hasattr(torch, "_grouped_mm"):
        log.warning("this torch has no _grouped_mm; LoRA takes the per-segment kernel")
        return False
    generator = torch.Generator(device="cpu").manual_seed(0)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    x, a, b, g, h = values(40, 32), values(3, 8, 32), values(3, 24, 8), values(40, 24), values(40, 8)
    bounds = [(0, 7), (7, 7), (7, 40)]   # an empty group too
    # (the grouped call's operands on the device, each group's pair of float64 factors, jagged rows or sums)
    forms = [((x, a.mT), lambda s, e, k: (x[s:e], a[k].t()), True),
             ((g, b), lambda s, e, k: (g[s:e], b[k]), True),
             ((h.t(), x), lambda s, e, k: (h[s:e].t(), x[s:e]), False),
             ((g.t(), h), lambda s, e, k: (g[s:e].t(), h[s:e]), False)]
    try:
        offsets = torch.tensor([end for _, end in bounds], dtype=torch.int32).to(device)
        for form, ((left, right), factors, rows) in enumerate(forms):
            got = torch._grouped_mm(left.to(device), right.to(device), offs=offsets).double().cpu()
            pairs = [[t.double() for t in factors(s, e, k)] for k, (s, e) in enumerate(bounds)]
            join = torch.cat if rows else torch.stack
            expected = join([p @ q for p, q in pairs])
            magnitude = join([p.abs() @ q.abs() for p, q in pairs])
            terms = pairs[0][0].shape[1] if rows else x.shape[0]
            if not bool(((got - expected).abs() <= (2.0 ** -8 + terms * 2.0 ** -24) * magnitude).all()):
                log.warning("torch._grouped_mm's form %d disagrees with per-group products on %s; LoRA takes the "
                            "per-segment kernel", form, device)
                return False
    except (RuntimeError, NotImplementedError, ValueError) as error:
        log.warning("torch._grouped_mm is not usable on %s (%s); LoRA takes the per-segment kernel", device, error)
        return False
    return True


def grouped_fits(x: torch.Tensor, base: nn.Module) -> bool:
    """Whether grouped_mm can take this layer at all: bfloat16, and every operand 16-byte aligned (the kernel's
    TMA loads: the input's start, and rows of in / out features; the ranks are padded to 8)."""
    return (x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0
            and base.in_features % RANK_ALIGNMENT == 0 and base.out_features % RANK_ALIGNMENT == 0)


def grouped_pays(segments: list[_Segment], x: torch.Tensor, base: nn.Module) -> bool:
    """`auto`'s choice for a layer's adapters without dropout: grouped_mm on CUDA in bfloat16 for two or more
    adapters, where the kernel works."""
    if not grouped_fits(x, base):
        return False
    if KERNEL != "auto":
        return KERNEL == "grouped_mm"
    return x.is_cuda and len(segments) >= 2 and grouped_mm_works(x.device)


def linear_with_adapters(base: nn.Module, full_precision: bool, x: torch.Tensor, adapters: list[nn.Module],
                         bounds: list[tuple[int, int]], layout: object, cache: CastCache) -> torch.Tensor:
    """The base layer's output on `x` (tokens, in) with each adapter's update added on its own rows `bounds`.
    `full_precision`: the base is a plain float linear layer whose product this function computes itself; else
    (a quantized layer) the base runs as it is and the updates are added to its output in place. The adapters
    with dropout take the per-segment kernel, the others grouped_mm where it pays (`grouped_pays`): which kernel
    a job takes never depends on the other jobs' settings (so its rounding does not either)."""
    dtype = x.dtype
    segments = [_Segment(start, end, adapter.scaling, 1.0 - adapter.dropout if adapter.drops else 1.0)
                for adapter, (start, end) in zip(adapters, bounds, strict=True)]
    plain = [index for index, segment in enumerate(segments) if segment.keep == 1.0]
    if plain and grouped_pays([segments[index] for index in plain], x, base):
        dropping = [index for index in range(len(adapters)) if index not in plain]
        groups = [(plain, "grouped_mm")] + ([(dropping, "segments")] if dropping else [])
    else:
        groups = [(list(range(len(adapters))), "segments")]
    plans: list[_Plan] = []
    masters: list[torch.Tensor] = []
    for indices, kernel in groups:
        chosen = [adapters[index] for index in indices]
        chosen_segments = [segments[index] for index in indices]
        if kernel == "grouped_mm":
            plans.append(_grouped_plan(chosen, chosen_segments, x, base, layout, cache))
        else:
            plans.append(_Plan(chosen, chosen_segments, adapter_copies(cache, layout, chosen, dtype), "segments"))
        masters.extend(t for adapter in chosen for t in (adapter.lora_A, adapter.lora_B))
    if full_precision:
        return _LinearWithAdapters.apply(x, base.weight, base.bias, None, tuple(plans), *masters)
    base_out = base(x)
    if base_out.dtype != dtype:
        base_out = base_out.to(dtype)
    return _LinearWithAdapters.apply(x, None, None, base_out, tuple(plans), *masters)


def _grouped_plan(adapters: list[nn.Module], segments: list[_Segment], x: torch.Tensor, base: nn.Module,
                  layout: object, cache: CastCache) -> _Plan:
    """Groups over the whole stream in order: each adapter's segment, and zero-weight groups for the rows between."""
    order = sorted(range(len(adapters)), key=lambda index: segments[index].start)
    members: list[nn.Module | None] = []
    ends: list[int] = []
    groups = [0] * len(adapters)
    position = 0
    for index in order:
        segment = segments[index]
        if segment.start > position:
            members.append(None)
            ends.append(segment.start)
        groups[index] = len(members)
        members.append(adapters[index])
        ends.append(segment.end)
        position = segment.end
    if position < x.shape[0]:
        members.append(None)
        ends.append(x.shape[0])
    scalings = tuple(0.0 if member is None else float(member.scaling) for member in members)
    offsets, scaling_tensor = _group_tensors(cache, layout, tuple(ends), scalings, x.device)
    copies = stacked_copies(cache, layout, members, x.dtype, base.in_features, base.out_features, x.device)
    return _Plan(adapters, segments, copies, "grouped_mm", groups, offsets, scaling_tensor)


def _group_tensors(cache: CastCache, layout: object, ends: tuple[int, ...], scalings: tuple[float, ...],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' int32 ends and (groups, 1, 1) float32 scalings on the device, made once per step: from pinned
    host memory, copied without waiting (the pinned tensors stay referenced by the cache until the next step)."""
    def make() -> tuple[torch.Tensor, ...]:
        host_ends = torch.tensor(ends, dtype=torch.int32)
        host_scalings = torch.tensor(scalings, dtype=torch.float32).view(-1, 1, 1)
        if device.type == "cuda":
            host_ends, host_scalings = host_ends.pin_memory(), host_scalings.pin_memory()
        return (host_ends, host_scalings, host_ends.to(device, non_blocking=True),
                host_scalings.to(device, non_blocking=True))

    tensors = cache.get(("groups", ends, scalings, str(device)), layout, (), make)
    return tensors[2], tensors[3]
