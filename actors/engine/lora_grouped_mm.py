"""`torch._grouped_mm` for the CUDA LoRA path (actors/engine/lora_cuda.py): whether it works on a device (its
self-check, once per device), whether a layer's operands fit it, and the groups it takes over a step's segments
(each job's rows, zero-weight groups between them) with their offsets and scalings on the device."""

from __future__ import annotations

import logging

import torch
from torch import nn

from actors.engine.lora_masters import RANK_ALIGNMENT

log = logging.getLogger(__name__)

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


def grouping(layout: object, adapters: list[nn.Module], segments: list, x: torch.Tensor) -> tuple:
    """Groups over the whole stream in order: each adapter's segment (`segments`: lora_cuda's, with start, end and
    scaling), and zero-weight groups for the rows between: (the adapter index of each group or None, each adapter's
    group, the groups' ends and scalings on the device)."""
    order = sorted(range(len(adapters)), key=lambda index: segments[index].start)
    member_of: list[int | None] = []
    ends: list[int] = []
    groups = [0] * len(adapters)
    position = 0
    for index in order:
        segment = segments[index]
        if segment.start > position:
            member_of.append(None)
            ends.append(segment.start)
        groups[index] = len(member_of)
        member_of.append(index)
        ends.append(segment.end)
        position = segment.end
    if position < x.shape[0]:
        member_of.append(None)
        ends.append(x.shape[0])
    scalings = tuple(0.0 if index is None else float(segments[index].scaling) for index in member_of)
    offsets, scaling_tensor = _group_tensors(layout, tuple(ends), scalings, x.device)
    return member_of, groups, offsets, scaling_tensor


def _group_tensors(layout: object, ends: tuple[int, ...], scalings: tuple[float, ...],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups' int32 ends and (groups, 1, 1) float32 scalings on the device, made once a step for every layer
    grouped alike: from pinned host memory, copied without waiting (the pinned tensors stay referenced until the
    step ends)."""
    tensors = layout.tensors
    key = ("lora-groups", ends, scalings, str(device))
    if key not in tensors:
        host_ends = torch.tensor(ends, dtype=torch.int32)
        host_scalings = torch.tensor(scalings, dtype=torch.float32).view(-1, 1, 1)
        if device.type == "cuda":
            host_ends, host_scalings = host_ends.pin_memory(), host_scalings.pin_memory()
        tensors[key] = (host_ends, host_scalings, host_ends.to(device, non_blocking=True),
                        host_scalings.to(device, non_blocking=True))
    entry = tensors[key]
    return entry[2], entry[3]
