"""Grouped LoRA: every plain adapter of a layer in a few batched products, whatever the number of jobs.

For CUDA, where a step of a small model is bound by kernel launches, not arithmetic: the jobs' token slices
gathered into one padded (jobs, longest slice, features) batch and every adapter run in two batched products
(`torch.bmm`) per distinct rank (adapters of equal rank stacked together), then the real rows brought back:
the same few launches per layer whatever the number of jobs (a job with dropout adds its own mask draw, from
its own generator). Each job's batch row holds only its own tokens (a shorter job's row is padded with its own
first token, and the padding's results are never read back), so no job's arithmetic, forward or backward,
touches another job's tokens: the isolation argument of the per-segment way holds unchanged, even if another
job's activations are inf or NaN. Used (auto) on CUDA when at least two adapters take part and padding at most
doubles the rows; GROUPING = "grouped" forces it for any number of adapters (tests, benchmarks, the operation
count)."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from actors.engine.layout import StepLayout
from actors.engine.lora_adapter import LoraAdapter

# "auto": grouped on CUDA, per segment elsewhere; "grouped" / "segments" force one way (tests, benchmarks)
GROUPING: Literal["auto", "grouped", "segments"] = "auto"
MAX_GROUP_PADDING = 2.0   # grouped only while the padded batch has at most this many times the real rows


class SegmentGroup:
    """Index tensors, built once per step, that gather the given token segments into a (segments, longest,
    features) batch (rows in the order the segments are given, which need not be stream order) and bring
    the batch's real rows back to the stream. A shorter segment's row is padded with copies of its own
    first token, so every row reads its own job's tokens only; the padding rows' results are never read
    back, so their gradients are exact zeros. Tokens outside the segments (a job with no adapter on this
    layer) get a zero row. Built with numpy and copied to the device once: no tensor operation per job."""

    def __init__(self, bounds: tuple[tuple[int, int], ...], num_tokens: int, device: torch.device):
        starts = np.array([start for start, _ in bounds], dtype=np.int64)
        lengths = np.array([end - start for start, end in bounds], dtype=np.int64)
        self.lengths = lengths.tolist()
        self.longest = int(lengths.max())
        self.count = len(bounds)
        column = np.arange(self.longest, dtype=np.int64)[None, :]
        gather = np.where(column < lengths[:, None], starts[:, None] + column, starts[:, None])
        # the real rows in stream order: (row, position) of each token of each segment, segments by start
        order = np.argsort(starts, kind="stable")
        ordered_lengths = lengths[order]
        covered = int(lengths.sum())
        offsets = np.cumsum(ordered_lengths) - ordered_lengths
        row_of = np.repeat(order, ordered_lengths)
        position_of = np.arange(covered, dtype=np.int64) - np.repeat(offsets, ordered_lengths)
        # where the segments do not cover the stream end to end: each token's real row, or the zero row
        # appended after the `covered` real rows
        self.scatter: torch.Tensor | None = None
        token_of = starts[row_of] + position_of
        if covered != num_tokens or not np.array_equal(token_of, np.arange(num_tokens)):
            scatter = np.full(num_tokens, covered, dtype=np.int64)
            scatter[token_of] = np.arange(covered, dtype=np.int64)
            self.scatter = torch.from_numpy(scatter).to(device)
        # segments of one length, back to back in row order from the stream's start: the batch is a view of
        # the stream and the result a reshape (no gathering, no index backward)
        self.regular = (self.scatter is None and bool((lengths == self.longest).all())
                        and np.array_equal(starts, np.arange(self.count) * self.longest))
        self.gather = torch.from_numpy(gather).to(device)
        self.row_of = torch.from_numpy(row_of).to(device)
        self.position_of = torch.from_numpy(position_of).to(device)
        self.device = device
        self.per_row: dict[tuple, torch.Tensor] = {}
        self.input_rows: tuple | None = None   # (input, its version, dtype, rows): `_input_rows`

    def row_values(self, values: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
        """One value per row (the adapters' scalings, their dropout keep probabilities) as a (segments, 1, 1)
        tensor on the device (one copy per step)."""
        key = (values, dtype)
        if key not in self.per_row:
            self.per_row[key] = torch.tensor(values, dtype=dtype).view(-1, 1, 1).to(self.device)
        return self.per_row[key]

    @staticmethod
    def of(layout: StepLayout, bounds: tuple[tuple[int, int], ...], device: torch.device) -> SegmentGroup:
        key = ("segment-group", bounds, str(device))
        if key not in layout.tensors:
            layout.tensors[key] = SegmentGroup(bounds, layout.num_tokens, device)
        return layout.tensors[key]


def use_grouping(adapters: list[LoraAdapter], bounds: list[tuple[int, int]], x: torch.Tensor) -> bool:
    if GROUPING == "segments" or len({adapter.lora_A.dtype for adapter in adapters}) > 1:
        return False
    if GROUPING == "grouped":
        return True
    if len(adapters) < 2:
        return False
    longest = max(end - start for start, end in bounds)
    return x.is_cuda and len(bounds) * longest <= MAX_GROUP_PADDING * sum(end - start for start, end in bounds)


def rank_order(adapters: list[LoraAdapter]) -> list[int]:
    """The adapters' indices with equal ranks next to each other (stable): the grouped way's row order."""
    return sorted(range(len(adapters)), key=lambda index: adapters[index].r)


def _stacked(parameters: list[torch.Tensor]) -> torch.Tensor:
    """The parameters stacked on a new first dimension: a view for one (no operation), else one stack."""
    return parameters[0].unsqueeze(0) if len(parameters) == 1 else torch.stack(parameters)


def _input_rows(group: SegmentGroup, flat_x: torch.Tensor, source: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """The group's (jobs, longest, in) batch of the input in the adapters' dtype. Layers that read the same
    input tensor one after another (q, k and v; gate and up) share one: one cast and gather, and one copy
    held for the backward instead of one per layer (on a GPU with bf16 layers and float32 adapters these
    copies were ~5 of the ~13 MB a token of a Llama-3.1-8B-shaped step). The group keeps the last input it
    was given (a reference to it: its memory cannot be reused while the entry stands) and its version, so
    an input changed in place or another tensor is never taken for it."""
    cached = group.input_rows
    if (source is not None and cached is not None and cached[0] is source and cached[1] == source._version
            and cached[2] == dtype):
        return cached[3]
    flat_x = flat_x.to(dtype)
    if group.regular:
        rows = flat_x.view(group.count, group.longest, flat_x.shape[-1])
    else:
        rows = flat_x[group.gather]                         # (jobs, longest, in)
    group.input_rows = None if source is None else (source, source._version, dtype, rows)
    return rows


def grouped_delta(adapters: list[LoraAdapter], group: SegmentGroup, flat_x: torch.Tensor,
                   source: torch.Tensor | None = None) -> torch.Tensor:
    """Every adapter's update on its own segment: (tokens, out_features), or for a regular group
    (jobs, longest, out_features) in stream order, not contiguous. `adapters` are in the group's row
    order with equal ranks adjacent (`rank_order`): one pair of batched products per distinct rank, so the
    operations per layer grow with the number of distinct ranks, never with the number of adapters.
    `source`: the layer's input tensor that `flat_x` views (its rows are shared with the layers before it
    that read the same tensor: `_input_rows`)."""
    dtype = adapters[0].lora_A.dtype
    rows = _input_rows(group, flat_x, source, dtype)
    if any(adapter.drops for adapter in adapters):
        # each adapter draws its own mask from its own generator (isolation); the padding rows and the jobs
        # without dropout keep ones; one division by the keep probabilities gives every mask its scale
        keep = torch.ones_like(rows)
        for index, (adapter, length) in enumerate(zip(adapters, group.lengths, strict=True)):
            if adapter.drops:
                keep[index, :length].bernoulli_(1.0 - adapter.dropout, generator=adapter.dropout_generator)
        probabilities = tuple(1.0 - adapter.dropout if adapter.drops else 1.0 for adapter in adapters)
        rows = rows * keep.div_(group.row_values(probabilities, dtype))
    scalings = group.row_values(tuple(adapter.scaling for adapter in adapters), dtype)
    updates = []
    start = 0
    while start < len(adapters):
        end = start
        while end < len(adapters) and adapters[end].r == adapters[start].r:
            end += 1
        bucket = adapters[start:end]
        lora_a = _stacked([a.lora_A for a in bucket])                                     # (jobs, rank, in)
        lora_b = _stacked([a.lora_B for a in bucket])                                     # (jobs, out, rank)
        # Products in the (features, tokens) orientation: the gradients of the stacked A and B then come out
        # in the parameters' own (rank, in) / (out, rank) layout, so each adapter's gradient is a view
        # autograd keeps as it is, where the (tokens, features) orientation made it copy every one (2 copies
        # per adapter and layer in each backward: on a GPU, launches that grew with the number of jobs).
        hidden = torch.bmm(lora_a, rows[start:end].transpose(1, 2))                       # (jobs, rank, longest)
        updates.append(torch.bmm(lora_b, hidden) * scalings[start:end])                    # (jobs, out, longest)
        start = end
    update = updates[0] if len(updates) == 1 else torch.cat(updates)
    if group.regular:   # (jobs, longest, out), strided: the caller's addition reads it as it lies
        return update.transpose(1, 2)
    real = update.transpose(1, 2)[group.row_of, group.position_of]                        # (real rows, out)
    if group.scatter is None:                                                             # stream order
        return real
    return F.pad(real, (0, 0, 0, 1))[group.scatter]                                       # zeros elsewhere
