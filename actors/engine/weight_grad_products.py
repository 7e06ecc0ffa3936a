"""The CUDA LoRA path's weight-gradient products over a step's jagged job segments: for each job (group) g,
left[rows_g]^T @ right[rows_g], a sum over the job's own tokens (dA = (g sB)^T x: Σ ranks x in; dB = g^T h: Σ outs x
Σ ranks), and which kernel computes them on this device.

- `grouped_mm`: `torch._grouped_mm` with jagged K (the groups' ends as offsets).
- `jagged`: a Triton kernel, one program per group and 128-wide output tile, summing the group's rows in blocks of
  64 from its first row. Why a candidate: at many jobs each group's sum is short (32 jobs of 128 tokens: two blocks)
  and a grouped GEMM's cost per tile and per group (its operands' descriptors made again for each group) may then
  outweigh the work; the H200 lease of 2026-12-04 lost most at 32 adapters (fusion 0.733 against 0.911 predicted),
  and which of the products lost it is what its `products` part and this choice measure.
  A group's rows are summed in the same blocks whatever other jobs share the step: isolation holds bit for bit.
- `auto` (the default): on CUDA, each shape (form, output size, the groups' count by powers of 2) is measured in a
  trainer's first steps and takes the least GPU plus host time a call (actors/engine/kernel_tuning.py: the host never
  waits, the steps keep grouped_mm's results until the choice). Elsewhere grouped_mm. Force `WAY` to repeat a run
  bit for bit.

`jagged` is checked once per device against float64 per-group products (`CHECK`); a failure logs why and the products
stay on grouped_mm. `tests/unit/engine/test_rank_products_interpreted.py` runs it under Triton's interpreter
(float32), `tests/gpu/test_rank_products_cuda.py` on a GPU (bfloat16, isolation bit for bit)."""

from __future__ import annotations

import logging
from typing import Literal

import torch

from actors.engine import kernel_tuning
from actors.engine.triton_support import KernelCheck, cdiv, next_power_of_2, tl, triton, triton_runs

log = logging.getLogger(__name__)

# "auto": measured per shape on CUDA (above), grouped_mm elsewhere; "grouped_mm" / "jagged" force one
WAY: Literal["auto", "grouped_mm", "jagged"] = "auto"
BLOCK_T = 64       # rows summed a step of a program's loop
WIDE = 128         # a tile's side along a wide dimension (features, outputs)


def sums(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(groups, M, N): each group's left[rows]^T @ right[rows], `left` (T, M), `right` (T, N), the groups' rows
    ending at `offsets` (int32, ascending, the last = T); float32 sums in `left`'s dtype."""
    if WAY == "grouped_mm" or (WAY == "auto" and left.device.type != "cuda"):   # inline: ~256 calls a step
        return torch._grouped_mm(left.t(), right, offs=offsets)
    return _tuned(left, right, offsets)


def _tuned(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`jagged` forced, or `auto` on CUDA: the shape's chosen kernel, or the next candidate while it is measured."""
    if WAY == "jagged":
        if triton_runs(left.device) and CHECK.works(left.device):
            return jagged(left, right, offsets)
        return torch._grouped_mm(left.t(), right, offs=offsets)
    key = ("weight-grad", left.shape[1], right.shape[1], offsets.shape[0].bit_length(), left.dtype,
           left.device.index)
    tuning = kernel_tuning.TUNINGS.get(key)
    if tuning is None:
        names = ["grouped_mm"] + (["jagged"] if triton_runs(left.device) and CHECK.works(left.device) else [])
        description = f"the weight gradients' sums, {left.shape[1]} x {right.shape[1]}, < {1 << key[3]} groups"
        tuning = kernel_tuning.TUNINGS[key] = kernel_tuning.Tuning(description, names)
    if tuning.chosen == "grouped_mm":
        return torch._grouped_mm(left.t(), right, offs=offsets)
    if tuning.chosen == "jagged":
        return jagged(left, right, offsets)
    return kernel_tuning.measured(tuning, lambda name: torch._grouped_mm(left.t(), right, offs=offsets)
                                  if name == "grouped_mm" else jagged(left, right, offsets))


def jagged(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The Triton kernel's `sums` (module docstring)."""
    rows, m = left.shape
    n = right.shape[1]
    groups = offsets.shape[0]
    out = torch.empty(groups, m, n, dtype=left.dtype, device=left.device)
    block_m = WIDE if m > 64 else max(16, next_power_of_2(m))
    block_n = WIDE if n > 64 else max(16, next_power_of_2(n))
    tiles_n = cdiv(n, block_n)
    _jagged_kernel[(cdiv(m, block_m) * tiles_n, groups)](
        left, right, offsets, out, m, n, tiles_n, left.stride(0), left.stride(1), right.stride(0), right.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=BLOCK_T)
    return out


def _agrees(device: torch.device) -> bool:
    """Groups of 70, 0, 5 and 128 rows (one empty, ends inside a row block), both forms' shapes (a narrow left: dA's;
    a narrow right: dB's), against float64 products of the same numbers: each entry within one rounding of the
    result's dtype plus float32's accumulation of the group's sum, relative to the sum of its terms' magnitudes."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    bounds = [(0, 70), (70, 70), (70, 75), (75, 203)]
    offsets = torch.tensor([end for _, end in bounds], dtype=torch.int32).to(device)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    within = []
    for m, n in ((24, 200), (200, 24)):
        left = torch.randn(203, m, generator=generator).to(device=device, dtype=dtype)
        right = torch.randn(203, n, generator=generator).to(device=device, dtype=dtype)
        got = jagged(left, right, offsets).double()
        for group, (start, end) in enumerate(bounds):
            first, second = left[start:end].double().t(), right[start:end].double()
            bound = (rounding + (end - start) * 2.0 ** -24) * (first.abs() @ second.abs())
            within.append(((got[group] - first @ second).abs() <= bound).all())
    return bool(torch.stack(within).all())   # one read of the device


CHECK = KernelCheck("the jagged weight-gradient kernel", "the sums stay on torch._grouped_mm", _agrees)


if triton is not None:
    @triton.jit
    def _jagged_kernel(left_ptr, right_ptr, ends_ptr, out_ptr, m, n, tiles_n, left_row, left_col, right_row,
                       right_col, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
        """Group g's output tile (ms, ns): Σ over its rows t of left[t, ms]^T right[t, ns], in BLOCK_T-row steps from
        its first row."""
        tile = tl.program_id(0)
        group = tl.program_id(1)
        ms = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        ns = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = ms < m
        n_ok = ns < n
        start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
        end = tl.load(ends_ptr + group)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            t_ok = ts < end
            a = tl.load(left_ptr + ts[None, :].to(tl.int64) * left_row + ms[:, None] * left_col,
                        mask=m_ok[:, None] & t_ok[None, :], other=0.0)                      # (BLOCK_M, BLOCK_T)
            b = tl.load(right_ptr + ts[:, None].to(tl.int64) * right_row + ns[None, :] * right_col,
                        mask=t_ok[:, None] & n_ok[None, :], other=0.0)                      # (BLOCK_T, BLOCK_N)
            acc += tl.dot(a, b)
        at = group.to(tl.int64) * m * n + ms[:, None].to(tl.int64) * n + ns[None, :]
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
