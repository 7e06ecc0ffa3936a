"""A GPU's ceilings and the time each recorded operation takes on it.

A kernel's time is max(compute, memory) plus a fixed cost per kernel, from a few parameters of the card,
each marked where it comes from (`Card.sources`):

- datasheet: dense bf16 and float32 (non-tensor-core) FLOP/s, HBM bytes/s, multiprocessors, PCIe bytes/s;
- measured: the bf16 matmul ceiling (8192^3) measured by the GPU suite on the same card;
- profile: read off the 2026-11-28 H200 profile's kernels, class by class, before any step was predicted
  (`profile_fit.py` aligns each profiled kernel with the recorded operation that launched it): the share of
  HBM bandwidth that contiguous (vectorised), strided or broadcast (generic) and transposed (uncoalesced)
  elementwise kernels reach; the least time a kernel takes and the GPU's gap between back-to-back kernels; float32 SIMT
  matmuls' bandwidth; the flash attention kernels' FLOP/s over the score tiles they compute; and the time one
  duplicate index adds to an accumulating index_put (CUDA adds an index's duplicates one after another).

The rules (`kernel_time`):
- matmuls with a rank-sized dimension (<= 64: the LoRA products): their bytes at a share of HBM bandwidth,
  float32 (no tensor cores unless TF32 is on) and bf16 each at its own profile's share (bf16: the grouped LoRA
  products of the 2026-12-04 profile, CUTLASS's grouped GEMM at ~25 µs a call; where a calibration predates it,
  the vectorised share, as decode-shaped GEMMs were assumed to run); other matmuls: FLOPs at the measured bf16
  ceiling, scaled down when the output has fewer 128x128 tiles than the card has multiprocessors, or bytes, the longer;
- attention: the FLOPs of the 128 x 128 score tiles it computes (per sequence; causal: the diagonal's and
  those below) at the attention rate: a short sequence fills few of its tiles;
- an accumulating index_put (a gather's backward): its bytes, plus the longest run of one index's
  duplicates times the serial cost, plus the sort's kernels;
- the backward of a slice or select: a zero fill of the whole input and a copy of the slice;
- every other operation: its bytes at the bandwidth of its class (vectorised / generic / transposed);
- host-device copies: bytes over PCIe (half of it from pageable memory) and the kernel cost.
Operations CUDA runs as several kernels (index_put with accumulate, logsumexp, the slice backward) launch
as many as the profile counted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gpu_cost.operations import ATTENTION, MATMULS, Op

SLICE_BACKWARDS = {"slice_backward", "select_backward", "diagonal_backward", "as_strided_backward",
                   "unfold_backward", "narrow_copy"}
# operations CUDA runs as several kernels, and how many times the data each touches (measured on the profile)
KERNELS = {"logsumexp": (9, 6.0)}
SKINNY = 64                    # a matmul dimension this small (a LoRA rank) makes it memory-bound
FP32_EFFICIENCY = 0.7          # share of the float32 peak a wide float32 SIMT matmul reaches (assumed)
INDEX_PUT_KERNELS = 9          # linear index, sort, the accumulation: as the profile counted (6326 / 702 calls)


@dataclass(frozen=True)
class Card:
    name: str
    peak_bf16: float           # FLOP/s, dense
    peak_fp32: float           # FLOP/s, without tensor cores
    hbm: float                 # bytes/s
    multiprocessors: int
    pcie: float                # bytes/s, pinned host memory
    gemm_bf16: float           # FLOP/s, measured bf16 matmul ceiling
    vectorised: float          # share of hbm
    generic: float
    transposed: float
    kernel_floor: float        # s, the least a kernel takes (added to its work)
    launch_gap: float          # s the GPU idles between back-to-back kernels
    fp32_skinny: float         # share of hbm a float32 matmul with a rank-sized dimension moves its operands at
    bf16_skinny: float         # the same for a bf16 / fp16 one (the grouped LoRA products)
    attention: float           # FLOP/s of the varlen flash kernels
    serial_add: float          # s per duplicate index in an accumulating index_put
    copy_latency: float = 8e-6   # s, a host-device copy's fixed cost (datasheet-class)
    sources: dict = field(default_factory=dict, compare=False)

    def scaled(self, **changes: float) -> Card:
        return replace(self, **changes)


H200_SOURCES = {
    "peak_bf16": "datasheet", "peak_fp32": "datasheet", "hbm": "datasheet", "multiprocessors": "datasheet",
    "pcie": "datasheet (PCIe 5 x16)", "gemm_bf16": "measured (GPU suite, 8192^3, 2026-11-28)",
    "vectorised": "profile", "generic": "profile", "transposed": "profile", "kernel_floor": "profile",
    "launch_gap": "profile", "fp32_skinny": "profile", "bf16_skinny": "profile (2026-12-04)", "attention": "profile",
    "serial_add": "profile",
    "copy_latency": "assumed",
}


def h200(profile: dict | None = None) -> Card:
    """The H200 of the 2026-11-28 profile; `profile`: the profile-measured values (calibration.json)."""
    values = {"vectorised": 0.9, "generic": 0.45, "transposed": 0.21, "kernel_floor": 1.0e-6, "launch_gap": 1.3e-6,
              "fp32_skinny": 0.2, "attention": 97e12, "serial_add": 0.7e-6}
    values.update(profile or {})
    values.setdefault("bf16_skinny", values["vectorised"])   # a calibration from before it was measured
    return Card("NVIDIA H200", peak_bf16=989.4e12, peak_fp32=66.9e12, hbm=4.8e12, multiprocessors=132,
                pcie=64e9, gemm_bf16=757e12, sources=dict(H200_SOURCES), **values)


def h100(profile: dict | None = None) -> Card:
    """An H100 SXM: datasheet ceilings; the measured and profile shares taken as the H200's (same
    architecture, sm_90), the matmul ceiling scaled by the same share of its peak."""
    card = h200(profile)
    sources = {key: (value if value == "datasheet" else f"{value}, from the H200")
               for key, value in card.sources.items()}
    return replace(card, name="NVIDIA H100 80GB HBM3", hbm=3.35e12, sources=sources)


CARDS = {"h200": h200, "h100": h100}


# -- the rules ---------------------------------------------------------------------------------------------
def _itemsize(dtype: str) -> int:
    return {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "bfloat16": 2, "float16": 2, "bool": 1,
            "uint8": 1, "int8": 1}.get(dtype, 4)


def bandwidth(card: Card, kind: str) -> float:
    return card.hbm * {"vectorised": card.vectorised, "generic": card.generic, "transposed": card.transposed}[kind]


def gemm_time(op: Op, card: Card) -> float:
    """A matmul's time: a skinny one (a dimension of at most SKINNY: a LoRA rank) moves its operands at a
    share of HBM bandwidth (float32 and bf16 / fp16 each at its profile's rate) unless its FLOPs take longer; a
    wide one runs at the bf16 ceiling, scaled down when its output
    has fewer 128 x 128 tiles than the card has multiprocessors (float32: FP32_EFFICIENCY of the peak)."""
    batch, m, n, k = op.gemm
    tensor_cores = op.dtype in ("bfloat16", "float16")
    peak = card.gemm_bf16 if tensor_cores else card.peak_fp32 * FP32_EFFICIENCY
    if min(m, n, k) <= SKINNY:
        rate = card.hbm * (card.bf16_skinny if tensor_cores else card.fp32_skinny)
        return max(op.bytes / rate, op.flops / peak)
    tiles = batch * math.ceil(m / 128) * math.ceil(n / 128)
    rate = peak * min(1.0, tiles / card.multiprocessors)
    return max(op.flops / rate, op.bytes / bandwidth(card, "vectorised"))


def kernel_time(op: Op, card: Card) -> float:
    """Seconds the GPU spends on one recorded operation (0 for one that launches nothing)."""
    if op.kind in ("h2d", "d2h"):
        pinned = op.detail.get("pinned_non_blocking", False)
        return card.copy_latency + op.read / (card.pcie if pinned else card.pcie / 2)
    if op.kind != "kernel" or op.launches == 0:
        return 0.0
    name = op.name
    launches = op.launches
    if name in MATMULS and op.gemm is not None:
        work = gemm_time(op, card)
    elif name in ATTENTION:
        tiles = op.detail.get("tile_flops", op.flops)
        work = tiles / card.attention if tiles else op.bytes / bandwidth(card, "vectorised")
    elif op.detail.get("accumulate"):
        launches = max(launches, INDEX_PUT_KERNELS)
        duplicates = op.detail.get("max_duplicates", 1)
        work = op.bytes / bandwidth(card, "vectorised") + max(duplicates - 1, 0) * card.serial_add
    elif name in SLICE_BACKWARDS and len(op.shapes) >= 2:
        launches = max(launches, 2)
        grad, full = op.shapes[0], op.shapes[-1]
        fill = math.prod(full[0]) * _itemsize(full[2])
        copied = math.prod(grad[0]) * _itemsize(grad[2])
        copy_kind = op.detail.get("layout", "generic")
        work = fill / bandwidth(card, "vectorised") + 2 * copied / bandwidth(card, copy_kind)
    elif name in KERNELS:
        count, passes = KERNELS[name]
        launches = max(launches, count)
        work = passes * op.read / bandwidth(card, "vectorised")
    else:
        work = op.bytes / bandwidth(card, op.detail.get("layout", "generic"))
    return launches * card.kernel_floor + work


def kernel_launches(op: Op) -> int:
    """Kernel launches of an operation on CUDA (what the host pays for), the multi-kernel ones included."""
    if op.kind in ("h2d", "d2h"):
        return 1
    if op.kind != "kernel" or op.launches == 0:
        return 0
    if op.detail.get("accumulate"):
        return max(op.launches, INDEX_PUT_KERNELS)
    if op.name in SLICE_BACKWARDS:
        return max(op.launches, 2)
    if op.name in KERNELS:
        return max(op.launches, KERNELS[op.name][0])
    return op.launches
