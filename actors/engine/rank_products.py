"""The CUDA LoRA path's two products whose output is rank-wide: the down projection h = x A^T and the backward's
g B (tokens x Σ ranks, each entry a sum over thousands of features), over a step's jagged job segments, and which
kernel computes them on this device.

- `grouped_mm`: `torch._grouped_mm` with the groups' ends as offsets. A grouped GEMM tiles only its output, and
  this output has one tile column and tokens / 128 tile rows: ~26 tiles for a 3,328-token step, so a fifth of an
  H100's or H200's 132 multiprocessors stream the whole input (the cost model's fitted third of HBM bandwidth for
  the grouped products, 2026-12-04, fits that).
- `split_k`: a Triton kernel over BLOCK_M-row blocks of the stream that also splits the sum over the features into
  parts of about `split_features` each (tokens / 64 x parts programs, >= 2 per multiprocessor on such a step); a row
  block's last part to finish adds the parts' float32 sums in order and rounds once (one launch: on a step whose
  host is as busy as its GPU, a second launch a product would cost the host more than the GPU gains: the cost model
  put it at +11 ms of host for -2 ms of GPU on the 8B step). A row block that holds the end of one job's segment and
  the start of the next computes each with its own job's factor, the other rows masked to zero.
  The number of parts comes from the feature count alone, so a job's rows are summed in the same order whatever
  other jobs share the step: isolation holds bit for bit, as grouped_mm's does.
- `auto` (the default): on CUDA, each shape (form, features, Σ ranks, the groups' count by powers of 2) is measured
  in a trainer's first steps, grouped_mm against split_k at each of `SPLIT_FEATURES`, and takes the least GPU plus
  host time a call (actors/engine/kernel_tuning.py: the host never waits, and the steps keep grouped_mm's results
  until the choice). Elsewhere grouped_mm. The choice is a measurement, so two runs may round differently; force
  `WAY` to repeat a run bit for bit.

`split_k` is checked once per device against float64 per-group products (`CHECK`); a failure logs why and the
products stay on grouped_mm. `tests/unit/engine/test_rank_products_interpreted.py` runs the kernel under Triton's
interpreter (float32); `tests/gpu/test_rank_products_cuda.py` on a GPU (bfloat16, isolation bit for bit)."""

from __future__ import annotations

import logging
from typing import Literal

import torch

from actors.engine import kernel_tuning
from actors.engine.triton_support import KernelCheck, cdiv, next_power_of_2, tl, triton, triton_runs

log = logging.getLogger(__name__)

# "auto": measured per shape on CUDA (above), grouped_mm elsewhere; "grouped_mm" / "split_k" force one
WAY: Literal["auto", "grouped_mm", "split_k"] = "auto"
SPLIT_FEATURES = (1024, 2048)   # split_k's candidate part sizes (features a program sums); a forced split_k: the first
BLOCK_M, BLOCK_K = 64, 128
MAX_WIDTH = 128                 # Σ ranks split_k takes (its tiles in shared memory); wider: grouped_mm


def down(x: torch.Tensor, a_stack: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's x A_g^T with its group's A (a_stack: (groups, Σ ranks, in)): (T, Σ ranks)."""
    if WAY == "grouped_mm" or (WAY == "auto" and x.device.type != "cuda"):   # inline: ~256 calls a step
        return torch._grouped_mm(x, a_stack.mT, offs=offsets)
    return _product(x, a_stack, offsets, True)


def grad_hidden(grad_out: torch.Tensor, b_stack: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's g B_g with its group's B (b_stack: (groups, Σ outs, Σ ranks)): (T, Σ ranks)."""
    if WAY == "grouped_mm" or (WAY == "auto" and grad_out.device.type != "cuda"):
        return torch._grouped_mm(grad_out, b_stack, offs=offsets)
    return _product(grad_out, b_stack, offsets, False)


def grouped(left: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    return torch._grouped_mm(left, weights.mT if transposed else weights, offs=offsets)


def split_k(left: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, transposed: bool,
            split_features: int = SPLIT_FEATURES[0]) -> torch.Tensor:
    """The split-K kernel's product (module docstring): `left` (T, K), `weights` (groups, N, K) read transposed
    (`transposed`) or (groups, K, N); float32 sums, `left`'s dtype. One launch: each row block's last part to finish
    adds the parts' float32 sums in order (a counter per row block, left at zero for the next launch)."""
    tokens, features = left.shape
    width = weights.shape[1] if transposed else weights.shape[2]
    parts = max(1, round(features / split_features))
    per_part = cdiv(cdiv(features, parts), BLOCK_K) * BLOCK_K
    parts = cdiv(features, per_part)
    out = torch.empty(tokens, width, dtype=left.dtype, device=left.device)
    if tokens == 0:
        return out
    blocks = cdiv(tokens, BLOCK_M)
    sums = out if parts == 1 else torch.empty(parts, tokens, width, dtype=torch.float32, device=left.device)
    w_group, w_k, w_n = ((weights.stride(0), weights.stride(2), weights.stride(1)) if transposed
                         else (weights.stride(0), weights.stride(1), weights.stride(2)))
    _rank_product_kernel[(blocks, parts)](
        left, weights, offsets, out, sums, _counters(left.device, blocks), tokens, features, width,
        offsets.shape[0], per_part, parts, left.stride(0), left.stride(1), w_group, w_k, w_n,
        BLOCK_M=BLOCK_M, BLOCK_N=max(16, next_power_of_2(width)), BLOCK_K=BLOCK_K)
    return out


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Zeroed int32 counters, one a row block, kept per device and stream (each launch leaves them at zero; two
    streams' launches at once would share none)."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device.type, device.index, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < blocks:
        counters = _COUNTERS[key] = torch.zeros(max(blocks, 256), dtype=torch.int32, device=device)
    return counters


# -- choosing the kernel ------------------------------------------------------------------------------------

def decisions() -> dict[str, dict]:
    """Each measured shape's choice and median times (ms): for benchmark reports (every tuned kernel's)."""
    return kernel_tuning.decisions()


def _candidates(device: torch.device, width: int) -> list[str]:
    names = ["grouped_mm"]
    if width <= MAX_WIDTH and triton_runs(device) and CHECK.works(device):   # (no Triton: grouped_mm alone)
        names += [f"split_k:{size}" for size in SPLIT_FEATURES]
    return names


def _run(name: str, left: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor,
         transposed: bool) -> torch.Tensor:
    if name == "grouped_mm":
        return grouped(left, weights, offsets, transposed)
    return split_k(left, weights, offsets, transposed, int(name.partition(":")[2]))


def _product(left: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`split_k` forced, or `auto` on CUDA: the shape's chosen kernel, or the next candidate while it is measured
    (actors/engine/kernel_tuning.py)."""
    width = weights.shape[1] if transposed else weights.shape[2]
    if WAY == "split_k":
        if width <= MAX_WIDTH and triton_runs(left.device) and CHECK.works(left.device):
            return split_k(left, weights, offsets, transposed)
        return grouped(left, weights, offsets, transposed)
    # the groups' count by its power of 2: a grouped GEMM's tiles round each group's rows up (32 jobs' 128-row segments
    # are not 4 jobs' 1,024), so the choice is measured again as the step's jobs grow
    key = ("rank", transposed, left.shape[1], width, offsets.shape[0].bit_length(), left.dtype, left.device.index)
    tuning = kernel_tuning.TUNINGS.get(key)
    if tuning is None:
        description = (f"{'x A^T' if transposed else 'g B'}, {left.shape[1]} features, {width} wide, "
                       f"< {1 << key[4]} groups")
        tuning = kernel_tuning.TUNINGS[key] = kernel_tuning.Tuning(description, _candidates(left.device, width))
    chosen = tuning.chosen
    if chosen == "grouped_mm":
        return torch._grouped_mm(left, weights.mT if transposed else weights, offs=offsets)
    if chosen is not None:
        return split_k(left, weights, offsets, transposed, int(chosen.partition(":")[2]))
    return kernel_tuning.measured(tuning, lambda name: _run(name, left, weights, offsets, transposed))


# -- the check ------------------------------------------------------------------------------------------------

def _agrees(device: torch.device) -> bool:
    """Both forms on groups of 70, 0, 5 and 128 rows (a block holding three groups' rows; an empty one), 300 features
    (not a multiple of the K block), ranks 24, against float64 products of the same numbers: each entry within one
    rounding of the result's dtype plus float32's accumulation of its sum, relative to the sum of its terms'
    magnitudes."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    bounds = [(0, 70), (70, 70), (70, 75), (75, 203)]
    tokens, features, rank = 203, 300, 24
    left = torch.randn(tokens, features, generator=generator).to(device=device, dtype=dtype)
    offsets = torch.tensor([end for _, end in bounds], dtype=torch.int32).to(device)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    within = []
    for transposed in (True, False):
        shape = (len(bounds), rank, features) if transposed else (len(bounds), features, rank)
        weights = torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
        got = split_k(left, weights, offsets, transposed, split_features=128).double()
        for group, (start, end) in enumerate(bounds):
            factor = (weights[group].t() if transposed else weights[group]).double()
            exact = left[start:end].double() @ factor
            magnitude = left[start:end].double().abs() @ factor.abs()
            within.append(((got[start:end] - exact).abs() <= (rounding + features * 2.0 ** -24) * magnitude).all())
    return bool(torch.stack(within).all())   # one read of the device


CHECK = KernelCheck("the split-K rank-wide LoRA product kernel", "the products stay on torch._grouped_mm", _agrees)


if triton is not None:
    @triton.jit
    def _rank_product_kernel(left_ptr, w_ptr, ends_ptr, out_ptr, sums_ptr, counts_ptr, tokens, features, width,
                             groups, per_part, parts, left_row, left_col, w_group, w_k, w_n,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Rows [block·BLOCK_M, +BLOCK_M) x features [part·per_part, +per_part): each group with rows in the block
        (`ends`: the groups' ends, ascending, the last = tokens) times its own factor, the other rows masked. With
        several parts, each stores its float32 sums; the block's last part to arrive adds them in part order."""
        block = tl.program_id(0)
        part = tl.program_id(1)
        first_row = block * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < width
        group = tl.full((), 0, tl.int32)
        for index in range(0, groups):   # the group holding the block's first row: the groups ending at or before it
            group += (tl.load(ends_ptr + index) <= first_row).to(tl.int32)
        k_first = part * per_part
        k_last = tl.minimum(k_first + per_part, features)
        last_row = tl.minimum(first_row + BLOCK_M, tokens)
        low = first_row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        while low < last_row:
            end = tl.load(ends_ptr + group)
            row_ok = (rows >= low) & (rows < end)
            for k0 in range(k_first, k_last, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < k_last
                a = tl.load(left_ptr + rows[:, None].to(tl.int64) * left_row + ks[None, :] * left_col,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + group.to(tl.int64) * w_group + ks[:, None] * w_k + cols[None, :] * w_n,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc += tl.dot(a, w)
            low = tl.maximum(low, end)
            group += 1
        at = rows[:, None].to(tl.int64) * width + cols[None, :]
        ok = (rows < tokens)[:, None] & col_ok[None, :]
        if parts == 1:
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            stride = tokens.to(tl.int64) * width
            tl.store(sums_ptr + part * stride + at, acc, mask=ok)
            tl.debug_barrier()   # every thread's sums stored before the arrival is counted (released)
            arrived = tl.atomic_add(counts_ptr + block, 1, sem="acq_rel", scope="gpu")
            if arrived == parts - 1:   # the last: every other part's sums are visible (acquired)
                tl.debug_barrier()
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in range(0, parts):
                    total += tl.load(sums_ptr + other * stride + at, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(counts_ptr + block, 0)
