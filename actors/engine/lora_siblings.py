"""Adapted layers that read one input (q, k and v; gate and up: "siblings") on the CUDA LoRA path, computed together.

On a host-bound step each launch counts (on the H200 of 2026-12-04 a launching operation cost the host ~75 µs). A
layer alone on grouped_mm (actors/engine/lora_cuda.py) launches 3 products in its forward and 6 operations in its
backward, and autograd sums the siblings' input gradients after (2 more for q, k and v). Together, in one autograd
function (`_SiblingLinears`):
- forward: one grouped down projection over the siblings' stacked As (groups, Σ ranks, in), one up projection by the
  stacked Bs on a diagonal (groups, Σ outs, Σ ranks) into a (tokens, Σ outs) output, and one base GEMM over the layers'
  frozen weights, made rows of one tensor when every sibling joins (actors/engine/sibling_weights.py), accumulating
  into it; each layer's output is its columns of it (detached views, so that RoPE may rotate q and k in place: the
  row-strided kernels of actors/engine/strided_kernels.py take them where they lie);
- backward: the layers' output gradients side by side (as they lie where SwiGLU's backward wrote them into the gate
  and up columns, else one copy), one grouped product by the Bs' stack for every layer's (g sB), one by the As' stack
  for the LoRA share of the input gradient, the base's `g W` over the stacked weights accumulated into it, and one
  product each for the stacked A and B gradients, added into the jobs' buffers by one launch
  (`lora_grad_kernel.GroupTargets` with a block per layer).
q, k and v: 10 launches instead of 29 one by one; gate and up: 9 instead of 19. Where a sibling does not join (or the
weights cannot be stacked: `sibling_weights.fused_weights`), the joining layers' up projections and base GEMMs run one
by one (q, k and v: 16 launches).

Each job's update reads its own rows only (the same groups as each layer's), so a NaN in one job's rows reaches no
other job; within a job, zeros of the other layers' blocks multiply its values and gradients (a NaN there is the job's
own). The outputs equal the layers' computed one by one (the same products; a GPU's GEMM over the stacked weights may
tile them otherwise, so to its rounding); the input gradient sums the same terms in
another order, so a job's rounding there depends on which siblings the step's jobs adapt (and on their ranks), as on
a GPU its base GEMM's does on the step's token count: "auto" takes this path on CUDA only, where a job fused is not
bit for bit the job alone anyway; the CPU's paths keep that guarantee.

The siblings called with one input tensor share its computation: the first called computes every sibling's output
and the others find theirs kept for that input (`SiblingSet.output`); a layer called with another input while
outputs wait, a layer called again, or one whose adapters do not fit (`_join`: dropout, another kind, other jobs or
scalings, ranks not of one multiple of 8, an adapter not pooled), is computed alone."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from actors.engine import lora_cuda, rank_products, weight_grad_products
from actors.engine.lora_adapter import full_precision
from actors.engine.lora_grad_kernel import Block, GroupTargets, kernel_works
from actors.engine.lora_grouped_mm import grouped_mm_works
from actors.engine.lora_layer_state import layer_adapters
from actors.engine.lora_masters import RANK_ALIGNMENT
from actors.engine.lora_stacks import KEEP, KEPT
from actors.engine.sibling_weights import REFUSED, Stacked, fused_weights

log = logging.getLogger(__name__)

# the layers of one parent module that read one input, by name (Llama, Mistral, Qwen, Gemma and most decoders)
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# "auto": on CUDA where the views' products passed their check (`views_work`); "on": on any device (tests,
# benchmarks); "off": every layer alone
SIBLINGS: Literal["auto", "on", "off"] = "auto"
_CHECKED: dict[tuple[str, int | None], bool] = {}


class SiblingSet:
    """The wrapped layers of one parent that read one input (`SIBLING_NAMES`), made by adapter surgery when a layer
    is wrapped or unwrapped."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.static: dict[int, tuple] = {}   # id(layer) -> (what `_fits` read, whether it fits), kept
        self.stacked: Stacked | None = None  # the layers' frozen weights as rows of one tensor, once all join

    def taken(self, layer: nn.Module, x: torch.Tensor, layout: object) -> torch.Tensor | None:
        """`layer`'s output on `x` where a sibling computed it (once: a second call computes again), else None."""
        key = ("lora-siblings", id(self))
        kept = layout.tensors.get(key)
        if kept is None or kept[0]() is not x or kept[1] != x._version:
            return None
        out = kept[2].pop(id(layer), None)
        if not kept[2]:   # every sibling took its output: nothing of this call stays with the step
            del layout.tensors[key]
        return out

    def output(self, layer: nn.Module, x: torch.Tensor, flat_x: torch.Tensor, layout: object) -> torch.Tensor | None:
        """`layer`'s output (tokens, out) on `x` (`flat_x` its (tokens, in) view): kept from a sibling's call on the
        same tensor, or computed now with every sibling that fits and kept for them; None: compute it alone."""
        tensors = layout.tensors
        key = ("lora-siblings", id(self))
        kept = tensors.get(key)
        if kept is not None and kept[2]:   # siblings' outputs still to be taken: this call is alone
            return None
        if not _enabled(flat_x):
            return None
        joined = _join(self, layer, flat_x, layout)
        if joined is None:
            return None
        members, plan = joined
        anchor = lora_cuda.anchor_of(flat_x.device) if plan.targets is not None else None
        outs = _SiblingLinears.apply(flat_x, plan, anchor)
        # the input by a weak reference: the step's layout outlives the layer's call, the input need not
        tensors[key] = (weakref.ref(x), x._version, {id(member): out for member, out in zip(members, outs, strict=True)
                                                     if member is not layer})
        return outs[members.index(layer)]


def _enabled(flat_x: torch.Tensor) -> bool:
    if SIBLINGS == "off":
        return False
    if SIBLINGS == "on":
        return True
    return flat_x.is_cuda and views_work(flat_x.device)


@dataclass
class _Plan:
    """What the siblings compute together this step: the stacks, each layer's block in them, the groups."""
    stacks: tuple[torch.Tensor, torch.Tensor]   # As (groups, Σ ranks, in); s·Bs on a diagonal (groups, Σ outs, Σ ranks)
    blocks: list[Block]
    offsets: torch.Tensor                       # the groups' int32 ends
    scalings: torch.Tensor                      # (groups, 1, 1) float32
    targets: GroupTargets | None                # where the gradients go (None: no backward takes any)
    tensors: dict                               # the step's
    bases: list[tuple[torch.Tensor, torch.Tensor | None]]   # each layer's frozen weight and bias
    stacked: Stacked | None                     # the same as rows of one tensor (every layer of the set joined)


def _join(siblings: SiblingSet, layer: nn.Module, flat_x: torch.Tensor, layout: object
          ) -> tuple[list[nn.Module], _Plan] | None:
    """(the siblings computed with `layer`, in order, and their plan), once a step per calling layer; None where
    fewer than two fit."""
    tensors = layout.tensors
    key = ("lora-sibling-plan", id(siblings), id(layer), flat_x.dtype, flat_x.shape[0], torch.is_grad_enabled())
    if key in tensors:
        return tensors[key]
    joined = None
    if lora_cuda.applies(flat_x.device, flat_x.dtype) and flat_x.data_ptr() % 16 == 0:
        fitting = [found for found in (_fits(siblings, member, flat_x, layout) for member in siblings.layers)
                   if found is not None]
        mine = [found for found in fitting if found[0] is layer]
        if mine:
            grouping = mine[0][3]
            fitting = [found for found in fitting if found[3][2] is grouping[2] and found[3][3] is grouping[3]
                       and found[3][0] == grouping[0]]
            taking = {found[2].takes_gradients() for found in fitting}
            if len(fitting) >= 2 and len(taking) == 1:   # (adapters frozen in one layer only: each alone)
                joined = ([found[0] for found in fitting], _plan(siblings, fitting, flat_x, layout, taking.pop()))
    tensors[key] = joined
    return joined


def _fits(siblings: SiblingSet, member: nn.Module, flat_x: torch.Tensor, layout: object) -> tuple | None:
    """(the layer, its adapters, their layer state, their grouping) where the layer can join: plain pooled adapters
    without dropout, each of the layer's one rank (a multiple of 8), on grouped_mm over a full-precision base of
    the input's dtype, its features multiples of 8. What depends on the adapters alone is kept while the step's jobs
    and the layer's adapters stay the same ones."""
    _, plain, bounds, rest, float32 = member._jobs_in(layout)
    base = member.base
    static = (layout.tensors.get("segment-names"), member.adapters.version, member.adapters.training, flat_x.dtype)
    known = siblings.static.get(id(member))
    if known is None or known[0] != static:
        ranks = {adapter.r for adapter in plain}
        fits = (bool(plain) and not rest and float32 and full_precision(base) and base.weight.dtype == flat_x.dtype
                and base.in_features % RANK_ALIGNMENT == 0 and base.out_features % RANK_ALIGNMENT == 0
                and len(ranks) == 1 and next(iter(ranks)) % RANK_ALIGNMENT == 0
                and not any([adapter.drops or adapter.master_pool is None for adapter in plain]))
        known = siblings.static[id(member)] = (static, fits)
    if not known[1]:
        return None
    entry = layer_adapters(base, plain)
    structure = lora_cuda.structure_of(layout, plain, bounds, flat_x, base, entry.signature)
    if len(structure) != 1 or structure[0][1] != "grouped_mm":
        return None
    return member, plain, entry, structure[0][3]


def _plan(siblings: SiblingSet, fitting: list[tuple], flat_x: torch.Tensor, layout: object, taking: bool) -> _Plan:
    dtype = flat_x.dtype
    blocks: list[Block] = []
    member_lists: list[list] = []
    weight_lists: list[list] = []
    rank_start = out_start = 0
    for member, plain, entry, grouping in fitting:
        member_of = grouping[0]
        copies = entry.weights(layout, dtype)   # each job's cast refreshed once a step
        members, weights = entry.members(dtype, list(range(len(plain))), member_of, copies)
        rank, out = plain[0].r, member.base.out_features
        blocks.append(Block(rank_start, rank, out_start, out))
        member_lists.append(members)
        weight_lists.append(weights)
        rank_start += rank
        out_start += out
    stacks = _stacks(siblings, blocks, member_lists, weight_lists, flat_x, rank_start, out_start)
    member_of, _, offsets, scalings = fitting[0][3]
    targets = _targets(siblings, fitting, blocks, stacks, flat_x.device) if taking else None
    stacked = None
    if [found[0] for found in fitting] == siblings.layers:   # all of them, in order: their weights stacked once
        siblings.stacked = fused_weights([found[0].base for found in fitting], siblings.stacked)
        stacked = siblings.stacked if siblings.stacked is not REFUSED else None
    return _Plan(stacks, blocks, offsets, scalings, targets, layout.tensors,
                 [(found[0].base._parameters["weight"], found[0].base._parameters.get("bias")) for found in fitting],
                 stacked)


def _stacks(siblings: SiblingSet, blocks: list[Block], member_lists: list[list], weight_lists: list[list],
            flat_x: torch.Tensor, ranks: int, outs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The siblings' stacks, kept between steps (`lora_stacks.KEPT`, refreshed with every layer's in one launch) while
    the same adapters fill them: each group's As one above another, its s·Bs on the diagonal (zeros elsewhere)."""
    key = (flat_x.dtype, tuple(tuple(map(id, members)) for members in member_lists))
    kept = KEPT.find(siblings, key) if KEEP else None
    if kept is not None:
        KEPT.refresh()
        return kept
    groups = len(member_lists[0])
    a_stack = torch.zeros(groups, ranks, flat_x.shape[1], dtype=flat_x.dtype, device=flat_x.device)
    b_stack = torch.zeros(groups, outs, ranks, dtype=flat_x.dtype, device=flat_x.device)
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for block, members, weights in zip(blocks, member_lists, weight_lists, strict=True):
        pairs = iter(weights)
        rows = slice(block.rank_start, block.rank_start + block.rank)
        for group, member in enumerate(members):
            if member is None:
                continue
            lora_a, lora_b = next(pairs)
            targets.extend((a_stack[group, rows], b_stack[group, block.out_start:block.out_start + block.out, rows]))
            sources.extend((lora_a, lora_b))
    with torch.no_grad():
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)
    if KEEP:
        KEPT.keep(siblings, key, (a_stack, b_stack), targets, sources)
    return a_stack, b_stack


def _targets(siblings: SiblingSet, fitting: list[tuple], blocks: list[Block], stacks: tuple[torch.Tensor, torch.Tensor],
             device: torch.device) -> GroupTargets:
    """Where the stacked gradients go, kept on the set while the same adapters fill the same groups."""
    key = tuple((tuple(map(id, plain)), tuple(grouping[0])) for _, plain, _, grouping in fitting)
    found = siblings.__dict__.get("_targets")
    if found is None or found[0] != key:
        pools = {id(adapter.master_pool[0]): adapter.master_pool[0] for _, plain, _, _ in fitting for adapter in plain}
        views = [GroupTargets.views_of(plain, grouping[0]) for _, plain, _, grouping in fitting]
        found = (key, GroupTargets(list(pools.values()), blocks, views, stacks[0].shape, stacks[1].shape, device,
                                   kernel_works(device)))
        siblings.__dict__["_targets"] = found
    return found[1]


class _SiblingLinears(torch.autograd.Function):
    """Every sibling's y_m = x W_m^T + b_m, each job's s·dropout-free update on its own rows added: the module
    docstring's launches. Inputs: x, the plan (with the layers' frozen weights and biases: no inputs of autograd's,
    whose every argument costs the host a call), an anchor (a leaf needing a gradient, so that the backward runs
    where x needs none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: _Plan, anchor: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        a_stack, b_stack = plan.stacks
        offsets = plan.offsets
        hidden = rank_products.down(x, a_stack, offsets)                                        # (T, Σ ranks)
        if plan.stacked is not None:   # one product by the diagonal stack, one base GEMM over the stacked weights
            out = torch._grouped_mm(hidden, b_stack.mT, offs=offsets)                              # (T, Σ outs)
            if plan.stacked.bias is not None:
                out.add_(plan.stacked.bias)
            out.addmm_(x, plan.stacked.weight.t())
            # each layer's columns, detached: views of one output would forbid the in-place RoPE on q and k
            outs = [part.detach() for part in out.split([block.out for block in plan.blocks], dim=1)]
        else:
            outs = []
            for block, (weight, bias) in zip(plan.blocks, plan.bases, strict=True):
                rows = slice(block.rank_start, block.rank_start + block.rank)
                b_block = b_stack[:, block.out_start:block.out_start + block.out, rows]
                out = torch._grouped_mm(hidden[:, rows], b_block.mT, offs=offsets)                # (T, out)
                if bias is not None:
                    out.add_(bias)
                out.addmm_(x, weight.t())
                outs.append(out)
        ctx.plan = plan
        ctx.save_for_backward(x, hidden)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, hidden = ctx.saved_tensors
        plan = ctx.plan
        a_stack, b_stack = plan.stacks
        offsets = plan.offsets
        grad_out = side_by_side(grads)                                                            # (T, Σ outs)
        grad_hidden = rank_products.grad_hidden(grad_out, b_stack, offsets)                       # (T, Σ ranks)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_hidden, a_stack, offs=offsets)                        # (T, in)
            if plan.stacked is not None:
                grad_x.addmm_(grad_out, plan.stacked.weight)
            else:
                for block, (weight, _) in zip(plan.blocks, plan.bases, strict=True):
                    grad_x.addmm_(grad_out[:, block.out_start:block.out_start + block.out], weight)
        if plan.targets is not None:
            plan.targets.add(weight_grad_products.sums(grad_hidden, x, offsets),
                             weight_grad_products.sums(grad_out, hidden, offsets), plan.scalings, plan.tensors)
        return grad_x, None, None


def side_by_side(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The layers' output gradients as one (T, Σ outs) tensor: the tensor they are columns of where they already lie
    side by side in one (a backward that wrote them in place into the stacked output's columns: the strided SwiGLU's),
    else their concatenation (one copy)."""
    first = grads[0]
    rows, row_stride = first.shape[0], first.stride(0)
    width = sum(grad.shape[1] for grad in grads)
    adjacent = row_stride == width and first.storage_offset() % row_stride == 0
    column = 0
    for grad in grads:
        adjacent = (adjacent and grad.dim() == 2 and grad.shape[0] == rows and grad.dtype == first.dtype
                    and grad.stride() == (row_stride, 1) and grad.untyped_storage().data_ptr()
                    == first.untyped_storage().data_ptr() and grad.storage_offset() == first.storage_offset() + column)
        column += grad.shape[1]
    if adjacent:
        return first.as_strided((rows, width), (row_stride, 1))
    return torch.cat(grads, dim=1)


def views_work(device: torch.device) -> bool:
    """Whether `torch._grouped_mm` takes the views this path gives it (a layer's columns of the shared down
    projection, rows Σ ranks apart; its block of the Bs' stack) and agrees with per-group products, checked once per
    device with grouped_mm's own check (`lora_grouped_mm.grouped_mm_works`): an error or a mismatch logs why and the
    layers are computed one by one."""
    key = (device.type, device.index)
    if key not in _CHECKED:
        _CHECKED[key] = grouped_mm_works(device) and _views_agree(device)
    return _CHECKED[key]


def _views_agree(device: torch.device) -> bool:
    """Two layers' blocks (ranks 8 and 16, outputs 16 and 24) of a (40, 24) down projection and a (3, 40, 24) stack,
    on groups of 7, 0 and 33 rows, against float64 products of the same bfloat16 numbers: each entry within one
    bfloat16 rounding plus the float32 accumulation of its sum, relative to the sum of its terms' magnitudes."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(40, 24, generator=generator).to(torch.bfloat16)
    stack = torch.randn(3, 40, 24, generator=generator).to(torch.bfloat16)
    bounds = [(0, 7), (7, 7), (7, 40)]
    try:
        offsets = torch.tensor([end for _, end in bounds], dtype=torch.int32).to(device)
        on_device, stack_on_device = hidden.to(device), stack.to(device)
        for rank_start, rank, out_start, out in ((0, 8, 0, 16), (8, 16, 16, 24)):
            rows, outs = slice(rank_start, rank_start + rank), slice(out_start, out_start + out)
            got = torch._grouped_mm(on_device[:, rows], stack_on_device[:, outs, rows].mT,
                                    offs=offsets).double().cpu()
            pairs = [(hidden[s:e, rows].double(), stack[k, outs, rows].double().t()) for k, (s, e) in enumerate(bounds)]
            expected = torch.cat([p @ q for p, q in pairs])
            magnitude = torch.cat([p.abs() @ q.abs() for p, q in pairs])
            if not bool(((got - expected).abs() <= (2.0 ** -8 + rank * 2.0 ** -24) * magnitude).all()):
                log.warning("torch._grouped_mm disagrees with per-group products on views of a stack on %s; adapted "
                            "layers that share an input are computed one by one", device)
                return False
    except (RuntimeError, NotImplementedError, ValueError) as error:
        log.warning("torch._grouped_mm does not take views of a stack on %s (%s); adapted layers that share an input "
                    "are computed one by one", device, error)
        return False
    return True
