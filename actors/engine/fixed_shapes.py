"""Fused steps of a fixed shape, for steps captured once as a CUDA graph and replayed (actors/engine/step_graphs.py).

A graph replays the kernels it captured with the shapes, host numbers and addresses it captured; a packed step's
change every step (its token count, where each job's tokens lie, how many sequences it holds). A fixed shape keeps
every one of them from step to step:

- each job's tokens lie in a segment of its own of a fixed `capacity`, its micro-batch's sequences packed at its
  start and the rest of the segment one padding sequence (no targets; inside the job's segment, so each job's
  segment, and everything the LoRA layers make of the segments, is the same every step);
- the sequences' bounds are a fixed number of slots (`slots` per job: its rows and its padding), those not used
  empty (zero-length sequences at the job's segment end), and the varlen attention's longest sequence the largest
  capacity: the bounds are values in a device buffer, not numbers the host passes;
- every position is a target slot: a position without a target has target id 0 and job index `len(jobs)` (a
  slot of no job, weight 0), so the loss's shapes never change either.

Isolation: a padding token is in no sequence with a real token (the attention is block-diagonal over the
sequences) and no target reads it, so the loss's gradient at its rows is exactly zero; its adapter rows (its job's)
add exact zeros to that job's gradients. A job's segment starts at `ROOM` times its first micro-batch's tokens (at
most what its largest micro-batch can hold: batch_size x max_seq_len) and only grows, doubling, where one does not
fit: a job set's shape settles after its first steps (each new shape is a new capture)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.engine.compiled import bucket_length
from actors.engine.layout import StepLayout
from actors.engine.packing import FusedBatch

NO_JOB_TARGET = 0   # the target id of a position without a target (its weight is 0: any id in the vocabulary)
ROOM = 4            # a job's first segment: this many times its first micro-batch's tokens (at most its ceiling)


@dataclass(frozen=True)
class FixedShape:
    """`jobs` in stream order; `capacity`: tokens of each job's segment; `slots`: each job's sequence slots (its
    rows' and one for its padding)."""

    jobs: tuple[str, ...]
    capacity: tuple[int, ...]
    slots: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.capacity)

    @property
    def longest(self) -> int:
        """The varlen attention's bound on a sequence's length (a padding sequence may fill a whole segment)."""
        return max(self.capacity)

    @property
    def segments(self) -> tuple[tuple[str, int, int], ...]:
        out, start = [], 0
        for job, capacity in zip(self.jobs, self.capacity, strict=True):
            out.append((job, start, start + capacity))
            start += capacity
        return tuple(out)

    def holding_counts(self, tokens: Sequence[int], rows: Sequence[int],
                       ceilings: Ceilings | None = None) -> FixedShape:
        """This shape where micro-batches of these tokens and rows (per job, in its order) fit it, else grown: each
        job that does not fit to twice its capacity (or the bucket of its tokens, if more; at most its ceiling), its
        slots to its rows and a padding slot."""
        needed = [bucket_length(count) for count in tokens]
        if all(have >= need for have, need in zip(self.capacity, needed, strict=True)) and all(
                have >= count + 1 for have, count in zip(self.slots, rows, strict=True)):
            return self
        limits = ceilings or ((None, 0),) * len(self.jobs)
        capacity = tuple(have if have >= need else max(need, _capped(2 * have, ceiling))
                         for have, need, (ceiling, _) in zip(self.capacity, needed, limits, strict=True))
        slots = tuple(max(have, count + 1) for have, count in zip(self.slots, rows, strict=True))
        return FixedShape(self.jobs, capacity, slots)


Ceilings = tuple[tuple[int | None, int], ...]   # per job: the most tokens and rows a micro-batch of it holds


def _capped(tokens: int, ceiling: int | None) -> int:
    return bucket_length(tokens if ceiling is None else min(tokens, ceiling))


def counts_of(batch: FusedBatch) -> tuple[list[int], list[int]]:
    """Each job's tokens and rows in a packed `batch`, in its order."""
    return [end - start for _, start, end in batch.layout.segments], _rows_per_job(batch)


def shape_for(jobs: tuple[str, ...], tokens: Sequence[int], rows: Sequence[int],
              ceilings: Ceilings | None = None) -> FixedShape:
    """A fixed shape for micro-batches of these tokens and rows (per job), with room to grow (a job's next
    micro-batches, of other lengths, fit it without a new capture): each job's segment `ROOM` times its tokens in a
    bucket length, at most its ceiling's bucket (never less than its tokens' bucket); its slots its ceiling's rows (or
    its micro-batch's) and one for its padding."""
    limits = ceilings or ((None, 0),) * len(jobs)
    capacity = tuple(max(bucket_length(count), _capped(ROOM * count, ceiling))
                     for count, (ceiling, _) in zip(tokens, limits, strict=True))
    slots = tuple(max(count, most) + 1 for count, (_, most) in zip(rows, limits, strict=True))
    return FixedShape(jobs, capacity, slots)


def _rows_per_job(batch: FusedBatch) -> list[int]:
    counts = []
    for _, start, end in batch.layout.segments:
        counts.append(sum(1 for first, _ in batch.layout.sequences if start <= first < end))
    return counts


@dataclass(kw_only=True)
class FixedBatch:
    """A step in a fixed shape, on the host: one int64 tensor holding, in order, the input ids, the position ids,
    the target ids and the target jobs (each one per position), the sequences' bounds (`cu_seqlens`, one more than
    the slots) and each job's target count; `packed`: the packed batch it was made from (its per-job counts are the
    step's report)."""

    shape: FixedShape
    values: torch.Tensor
    packed: FusedBatch

    def parts(self, values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`values` (this batch's, or a device buffer of the same layout) cut into its named parts (views)."""
        return split_parts(self.shape, self.values if values is None else values)


def split_parts(shape: FixedShape, values: torch.Tensor) -> dict[str, torch.Tensor]:
    tokens, sequences, jobs = shape.tokens, sum(shape.slots), len(shape.jobs)
    sizes = {"input_ids": tokens, "position_ids": tokens, "target_ids": tokens, "target_job": tokens,
             "cu_seqlens": sequences + 1, "job_targets": jobs}
    out, start = {}, 0
    for name, size in sizes.items():
        out[name] = values[start:start + size]
        start += size
    if start != values.numel():
        raise ValueError(f"a fixed batch of {values.numel()} values, not the {start} its shape holds")
    return out


def fixed_batch(batch: FusedBatch, shape: FixedShape, pad_token_id: int) -> FixedBatch:
    """The packed host `batch` (its jobs in `shape`'s order, each within its capacity and slots) in `shape`."""
    if tuple(batch.jobs) != shape.jobs:
        raise ValueError(f"a step of jobs {batch.jobs} in a fixed shape of jobs {list(shape.jobs)}")
    if batch.padding_tokens:
        raise ValueError("a fixed shape takes a packed step (layout: packed), not one with padding")
    tokens, jobs = shape.tokens, len(shape.jobs)
    input_ids = torch.full((tokens,), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(tokens, dtype=torch.long)
    target_ids = torch.full((tokens,), NO_JOB_TARGET, dtype=torch.long)
    target_job = torch.full((tokens,), jobs, dtype=torch.long)
    bounds: list[int] = [0]
    rows = _rows_per_job(batch)
    for index, ((_, start, end), (_, fixed_start, fixed_end)) in enumerate(
            zip(batch.layout.segments, shape.segments, strict=True)):
        length, capacity = end - start, fixed_end - fixed_start
        if length > capacity or rows[index] + 1 > shape.slots[index]:
            raise ValueError(f"job '{shape.jobs[index]}': {length} tokens in {rows[index]} rows do not fit its "
                             f"fixed segment of {capacity} tokens and {shape.slots[index]} sequence slots")
        shift = fixed_start - start
        input_ids[fixed_start:fixed_start + length] = batch.input_ids[start:end]
        position_ids[fixed_start:fixed_start + length] = batch.position_ids[start:end]
        position_ids[fixed_start + length:fixed_end] = torch.arange(capacity - length)
        bounds.extend(seq_end + shift for seq_start, seq_end in batch.layout.sequences if start <= seq_start < end)
        bounds.append(fixed_end)                                  # the padding sequence (empty when none)
        bounds.extend([fixed_end] * (shape.slots[index] - rows[index] - 1))   # unused slots: empty
        mine = batch.target_job == index
        positions = batch.target_index[mine] + shift
        target_ids[positions] = batch.target_ids[mine]
        target_job[positions] = index
    values = torch.cat([input_ids, position_ids, target_ids, target_job, torch.tensor(bounds, dtype=torch.long),
                        torch.tensor(batch.job_targets, dtype=torch.long)])
    return FixedBatch(shape=shape, values=values, packed=batch)


def fixed_layout(shape: FixedShape, cu_seqlens: torch.Tensor) -> StepLayout:
    """The layout of a step of `shape` whose sequence bounds are the device tensor `cu_seqlens` (int32), read by the
    varlen attention from there; its host `sequences` are each job's whole segment (no kernel of a fixed step reads
    them: the attention of a fixed step reads the bounds' tensor: attention.fixed_shape_attention)."""
    layout = StepLayout(shape.segments, tuple((start, end) for _, start, end in shape.segments), shape.tokens)
    layout.tensors[("cu_seqlens", str(cu_seqlens.device))] = cu_seqlens
    layout.tensors["max-sequence-length"] = shape.longest
    layout.tensors["fixed-shape"] = True
    return layout

