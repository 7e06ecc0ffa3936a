"""A candidate for the LoRA products whose output is rank-wide (h = x A^T, dh = g B: tokens x rank, summed over
thousands of features), timed by bench/lora_products.py beside `torch._grouped_mm`: a Triton kernel over the jobs'
row segments that also splits the sum over the features among programs (split-K), then adds the partial sums.

Why: a grouped GEMM tiles only its output, and this output has one tile column (rank <= 64) and tokens / 128 tile
rows: ~24-32 tiles for a 3-4k-token step, so ~a fifth of an H100's or H200's 132 multiprocessors stream the whole
input (the cost model's fitted third of HBM bandwidth for these products fits that). Here each segment's rows are cut
into BLOCK_M-row tiles and the feature sum into SPLIT parts, so tiles x SPLIT programs (>= 2 per multiprocessor) read
the input once; the partial sums (SPLIT x tokens x rank, float32) are added by torch in a fixed order
(deterministic). Not used by the engine: the lease measures it first (`products` part, way `split_k`)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - no Triton: the way is left out
    triton = tl = None

BLOCK_M, BLOCK_K = 64, 128
PROGRAMS_PER_MULTIPROCESSOR = 2


def tiles_of(bounds: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """(start, end, group) of each BLOCK_M-row tile of each segment, int32 on the device."""
    rows = [(start, min(start + BLOCK_M, end), group) for group, (first, end) in enumerate(bounds)
            for start in range(first, end, BLOCK_M)]
    return torch.tensor(rows, dtype=torch.int32).to(device)


def rank_product(left: torch.Tensor, weights: torch.Tensor, tiles: torch.Tensor, transposed: bool,
                 multiprocessors: int) -> torch.Tensor:
    """out[t] = left[t] @ W_g for each row t of segment g: `left` (T, K); `weights` (groups, N, K) read as W_g^T
    (`transposed`: x A^T, A (groups, r, K)) or (groups, K, N) read as W_g (g B, B (groups, K, r)). Float32 sums,
    the result in `left`'s dtype."""
    tokens, features = left.shape
    width = weights.shape[1] if transposed else weights.shape[2]
    split = max(1, min(features // BLOCK_K, -(-PROGRAMS_PER_MULTIPROCESSOR * multiprocessors // tiles.shape[0])))
    per_split = -(-features // (split * BLOCK_K)) * BLOCK_K
    split = -(-features // per_split)
    partial = torch.empty(split, tokens, width, dtype=torch.float32, device=left.device)
    w_group, w_k, w_n = ((weights.stride(0), weights.stride(2), weights.stride(1)) if transposed
                         else (weights.stride(0), weights.stride(1), weights.stride(2)))
    _partials[(tiles.shape[0], split)](left, weights, partial, tiles, left.stride(0), left.stride(1), w_group, w_k, w_n,
                                       partial.stride(0), partial.stride(1), features, width, per_split,
                                       BLOCK_M=BLOCK_M, BLOCK_N=max(16, 1 << (width - 1).bit_length()),
                                       BLOCK_K=BLOCK_K)
    return partial.sum(0).to(left.dtype)


if triton is not None:
    @triton.jit
    def _partials(left_ptr, w_ptr, part_ptr, tiles_ptr, left_row, left_col, w_group, w_k, w_n, part_split, part_row,
                  features, width, per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        part = tl.program_id(1)
        start = tl.load(tiles_ptr + 3 * tile)
        end = tl.load(tiles_ptr + 3 * tile + 1)
        group = tl.load(tiles_ptr + 3 * tile + 2).to(tl.int64)
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < width
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        first = part * per_split
        for k0 in range(first, first + per_split, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < features
            a = tl.load(left_ptr + rows[:, None].to(tl.int64) * left_row + ks[None, :] * left_col,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + group * w_group + ks[:, None] * w_k + cols[None, :] * w_n,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, w)
        tl.store(part_ptr + part.to(tl.int64) * part_split + rows[:, None].to(tl.int64) * part_row + cols[None, :],
                 acc, mask=row_ok[:, None] & col_ok[None, :])
