"""The token layout of the fused step in flight: where each sequence and each job's tokens lie in the
flattened token stream. Set by the trainer around a forward pass, read by the fused LoRA layers (which
adapter owns which tokens) and by the varlen attention (where each sequence starts and ends)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepLayout:
    """`segments`: (adapter name, start, end) per job, contiguous, in stream order.
    `sequences`: (start, end) of every row, a packed sequence or a padded row.
    `jobs`: (start, end) of each job's tokens where they are not the segments' (a reference pass names only the
    jobs with a reference adapter: actors/engine/preference.py)."""

    segments: tuple[tuple[str, int, int], ...]
    sequences: tuple[tuple[int, int], ...]
    num_tokens: int
    # what is built once per step and shared by every layer (device tensors such as cu_seqlens, the LoRA path's
    # plans): a new step has a new layout, so nothing outlives its step; a recomputed forward in the same step
    # finds it
    tensors: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    jobs: tuple[tuple[int, int], ...] = ()

    @property
    def job_ranges(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of each job's tokens, in stream order."""
        return self.jobs or tuple((start, end) for _, start, end in self.segments)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence's length (asked by every layer's attention: made once a step)."""
        longest = self.tensors.get("max-sequence-length")
        if longest is None:
            longest = self.tensors["max-sequence-length"] = max([end - start for start, end in self.sequences],
                                                                 default=0)
        return longest

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """The sequences' int32 bounds on `device` (a fused step's batch puts them there with its other tensors:
        `FusedBatch.to`; made here otherwise)."""
        key = ("cu_seqlens", str(device))
        if key not in self.tensors:
            bounds = [0] + [end for _, end in self.sequences]
            self.tensors[key] = torch.tensor(bounds, dtype=torch.int32, device=device)
        return self.tensors[key]

    @staticmethod
    def single(adapter: str, lengths: list[int]) -> StepLayout:
        """All tokens through one adapter, sequences of the given lengths back to back."""
        sequences, start = [], 0
        for length in lengths:
            sequences.append((start, start + length))
            start += length
        return StepLayout(((adapter, 0, start),), tuple(sequences), start)


def parts(tensor: torch.Tensor, bounds: list[tuple[int, int]] | tuple[tuple[int, int], ...], dim: int = 0
          ) -> list[torch.Tensor]:
    """The tensor's parts (start, end) along `dim` (in order, not overlapping), as the views of one split. Its
    backward writes each part's gradient once (one cat, zeros only in the gaps), where a slice a part would make a
    zero gradient of the whole tensor for each part and add them up: a step's cost growing with its jobs (or
    sequences, or experts x jobs) times its tokens. The values, and so every gradient, are the same either way."""
    sizes, kept, position = [], [], 0
    for start, end in bounds:
        if start < position:
            raise ValueError(f"parts: bounds {bounds} overlap or are not in order")
        if start > position:
            sizes.append(start - position)
        kept.append(len(sizes))
        sizes.append(end - start)
        position = end
    if position < tensor.shape[dim]:
        sizes.append(tensor.shape[dim] - position)
    split = torch.split(tensor, sizes, dim=dim)
    return [split[index] for index in kept]


_current: contextvars.ContextVar[StepLayout | None] = contextvars.ContextVar("aspen_step_layout", default=None)


def current_layout() -> StepLayout | None:
    return _current.get()


@contextlib.contextmanager
def step_layout(layout: StepLayout) -> Iterator[StepLayout]:
    token = _current.set(layout)
    try:
        yield layout
    finally:
        _current.reset(token)
