"""Building a fused step's batch from several jobs' micro-batches.

All layouts produce one flattened token stream, grouped by job, with position ids restarting per row:
- `packed`: whole sequences back to back, no padding at all;
- `padded`: each of a job's rows padded to the longest row of that job's micro-batch (what a solo run
  with padded batches processes);
- `padded_fused`: every row padded to the longest row of the whole fused step (the mLoRA layout).
Only positions whose next token is a training target are gathered for the LM head and the loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.data import Example
from actors.data.pairs import example_rows
from actors.engine.layout import StepLayout
from actors.spec.base_settings import Layout
from actors.storage.transfer import concatenated_to_device


@dataclass(frozen=True)
class JobMicroBatch:
    job: str
    examples: list[Example]   # or `PreferencePair`s: two sequences each

    @property
    def rows(self) -> list[Example]:
        """The micro-batch's sequences in stream order (a preference pair's two: chosen, then rejected)."""
        return example_rows(self.examples)

    @property
    def num_tokens(self) -> int:
        return sum(len(e) for e in self.examples)

    def padded_tokens(self, layout: Layout, fused_longest: int = 0) -> int:
        """Tokens this micro-batch occupies in a step of the given layout (padding included)."""
        if layout == "packed":
            return self.num_tokens
        rows = self.rows
        longest = max(len(e) for e in rows)
        if layout == "padded_fused":
            longest = max(longest, fused_longest)
        return longest * len(rows)


@dataclass(kw_only=True)
class FusedBatch:
    input_ids: torch.Tensor        # (T,) long
    position_ids: torch.Tensor     # (T,) long
    layout: StepLayout
    jobs: list[str]
    target_index: torch.Tensor     # (M,) stream positions whose next token is a target
    target_ids: torch.Tensor       # (M,) the target token at position + 1
    target_job: torch.Tensor       # (M,) index into `jobs`
    job_targets: list[int]         # number of target tokens per job
    job_tokens: list[int]          # real (unpadded) tokens per job
    padding_tokens: int
    job_target_counts: torch.Tensor | None = None   # `job_targets` as a tensor where the batch is (`to`)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return self.num_tokens - self.padding_tokens

    @property
    def sequence_lengths(self) -> list[int]:
        return [end - start for start, end in self.layout.sequences]

    def to(self, device: torch.device) -> FusedBatch:
        """The batch's tensors on `device` in one copy (actors/storage/transfer.py: on CUDA from pinned memory,
        without waiting), with the layout's `cu_seqlens` made there too, so that nothing in the step copies from
        the host again."""
        bounds = torch.tensor([0] + [end for _, end in self.layout.sequences], dtype=torch.long)
        counts = torch.tensor(self.job_targets, dtype=torch.long)
        (input_ids, position_ids, target_index, target_ids, target_job, cu_seqlens,
         job_target_counts) = concatenated_to_device([self.input_ids, self.position_ids, self.target_index,
                                                      self.target_ids, self.target_job, bounds, counts], device)
        self.layout.tensors[("cu_seqlens", str(cu_seqlens.device))] = cu_seqlens.to(torch.int32)
        return FusedBatch(input_ids=input_ids, position_ids=position_ids, layout=self.layout, jobs=self.jobs,
                          target_index=target_index, target_ids=target_ids, target_job=target_job,
                          job_targets=self.job_targets, job_tokens=self.job_tokens, padding_tokens=self.padding_tokens,
                          job_target_counts=job_target_counts)


def pack(micro_batches: list[JobMicroBatch], layout: Layout = "packed", pad_token_id: int = 0) -> FusedBatch:
    """One stream from the jobs' micro-batches, in the order given (each job's tokens contiguous)."""
    if not micro_batches:
        raise ValueError("a fused step needs at least one job's micro-batch")
    fused_longest = max(len(e) for mb in micro_batches for e in mb.rows)
    ids: list[int] = []
    positions: list[int] = []
    sequences: list[tuple[int, int]] = []
    segments: list[tuple[str, int, int]] = []
    target_index: list[int] = []
    target_ids: list[int] = []
    target_job: list[int] = []
    job_targets: list[int] = []
    job_tokens: list[int] = []
    padding = 0
    for job_index, micro_batch in enumerate(micro_batches):
        if not micro_batch.examples:
            raise ValueError(f"job '{micro_batch.job}' has an empty micro-batch")
        segment_start = len(ids)
        row_length = 0
        if layout == "padded":
            row_length = max(len(e) for e in micro_batch.rows)
        elif layout == "padded_fused":
            row_length = fused_longest
        targets_before = len(target_ids)
        for example in micro_batch.rows:
            start = len(ids)
            length = len(example)
            ids.extend(example.input_ids)
            labels = example.labels
            for t in range(length - 1):
                if labels[t + 1] != -100:
                    target_index.append(start + t)
                    target_ids.append(labels[t + 1])
            pad = max(row_length - length, 0)
            ids.extend([pad_token_id] * pad)
            positions.extend(range(length + pad))
            padding += pad
            sequences.append((start, len(ids)))
        target_job.extend([job_index] * (len(target_ids) - targets_before))
        job_targets.append(len(target_ids) - targets_before)
        job_tokens.append(micro_batch.num_tokens)
        segments.append((micro_batch.job, segment_start, len(ids)))
    step_layout = StepLayout(tuple(segments), tuple(sequences), len(ids))
    return FusedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        layout=step_layout,
        jobs=[mb.job for mb in micro_batches],
        target_index=torch.tensor(target_index, dtype=torch.long),
        target_ids=torch.tensor(target_ids, dtype=torch.long),
        target_job=torch.tensor(target_job, dtype=torch.long),
        job_targets=job_targets,
        job_tokens=job_tokens,
        padding_tokens=padding,
    )
