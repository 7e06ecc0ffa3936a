"""The evaluation split and the resumable, seeded micro-batch cursor over a job's examples."""

from __future__ import annotations

import random
from typing import Any

from actors.data.rows import DataError
from actors.data.tokenize import Example

# --------------------------------------------------------------------------
# Train / eval split
# --------------------------------------------------------------------------


def split_eval(
    examples: list[Example], eval_split: float | int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Seeded, deterministic split into ``(train, eval)``.

    ``eval_split`` < 1 is a fraction (a positive fraction gives at least one
    eval example), >= 1 a count, 0 an empty eval set.  Both lists keep the
    original order.  At least one train example must remain.
    """
    if isinstance(eval_split, bool) or not isinstance(eval_split, (int, float)):
        raise TypeError(f"eval_split must be a number, got {type(eval_split).__name__}")
    if eval_split < 0:
        raise ValueError(f"eval_split must be >= 0, got {eval_split}")
    total = len(examples)
    if eval_split == 0:
        n_eval = 0
    elif eval_split < 1:
        n_eval = max(1, round(eval_split * total))
    else:
        if float(eval_split) != int(eval_split):
            raise ValueError(f"eval_split >= 1 is a count and must be a whole number, got {eval_split}")
        n_eval = int(eval_split)
    if total - n_eval < 1:
        fix = (f"lower eval_split below {total} or add data" if eval_split >= 1 and total >= 2
               else "add data or set eval_split: 0" if eval_split >= 1
               else "add data (a fraction holds out at least one example) or set eval_split: 0")
        raise DataError(f"eval_split={eval_split} takes {n_eval} of {total} examples, leaving none to train on; {fix}")
    order = list(range(total))
    random.Random(seed).shuffle(order)
    eval_indices = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_indices]
    evaluation = [ex for i, ex in enumerate(examples) if i in eval_indices]
    return train, evaluation


# --------------------------------------------------------------------------
# Batch cursor
# --------------------------------------------------------------------------


class DataCursor:
    """Deterministic, resumable iteration over micro-batches of examples.

    Each epoch visits the examples in a fresh permutation seeded by
    ``(seed, epoch)``.  Batches wrap across epoch boundaries so every batch is
    full; with ``epochs`` set, the final batch may be shorter and
    ``next_batch`` then returns ``None``.

    ``epoch`` is the (0-based) epoch the next example comes from and
    ``position`` its index within that epoch's permutation; after the last
    epoch is finished, ``position == len(examples)`` and ``exhausted`` is true.
    That state restored into a cursor of more ``epochs`` (a job's epochs
    raised) goes on into the next epoch from its first example: its batches
    then differ from those of a cursor given the epochs from the start where
    the examples are not a multiple of ``batch_size`` (that epoch's last batch
    was short, not run on across the epoch's end).
    """

    def __init__(self, examples: list[Example], batch_size: int, seed: int, epochs: int | None = None) -> None:
        if not examples:
            raise DataError("no examples to iterate over")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.position = 0
        self.examples_seen = 0
        # the last epoch's order, by (seed, epoch): kept through `load_state_dict`, which a job actor calls
        # before each fetch (a shuffle of every example each time otherwise)
        self._perm_cache: tuple[int, int, list[int]] | None = None

    def __len__(self) -> int:
        """Number of examples per epoch."""
        return len(self.examples)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs - 1 and self.position >= len(self.examples)

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_cache is not None and self._perm_cache[:2] == (self.seed, epoch):
            return self._perm_cache[2]
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        self._perm_cache = (self.seed, epoch, order)
        return order

    def _plan(self, count: int, epoch: int, position: int) -> tuple[list[int], int, int]:
        """Indices of the next ``count`` examples from ``(epoch, position)``
        and the state after them, without touching ``self``'s position."""
        n = len(self.examples)
        indices: list[int] = []
        while len(indices) < count:
            if position >= n:
                if self.epochs is not None and epoch + 1 >= self.epochs:
                    break
                epoch, position = epoch + 1, 0
            take = min(count - len(indices), n - position)
            indices.extend(self._permutation(epoch)[position : position + take])
            position += take
        # Normalise: a finished epoch moves on to the next one unless it was the last.
        if position >= n and (self.epochs is None or epoch + 1 < self.epochs):
            epoch, position = epoch + 1, 0
        return indices, epoch, position

    def next_batch(self) -> list[Example] | None:
        """The next micro-batch, or ``None`` once ``epochs`` are exhausted."""
        indices, self.epoch, self.position = self._plan(self.batch_size, self.epoch, self.position)
        if not indices:
            return None
        self.examples_seen += len(indices)
        return [self.examples[i] for i in indices]

    def peek_lengths(self, n_batches: int = 1) -> list[int]:
        """Token lengths of the examples in the next ``n_batches`` batches (in
        order, flattened), without advancing."""
        if n_batches < 0:
            raise ValueError(f"n_batches must be >= 0, got {n_batches}")
        indices, _, _ = self._plan(self.batch_size * n_batches, self.epoch, self.position)
        return [len(self.examples[i]) for i in indices]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "examples_seen": self.examples_seen,
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by ``state_dict``; later batches are then
        exactly those the saved cursor would have produced."""
        missing = [k for k in ("epoch", "position", "examples_seen", "seed") if k not in state]
        if missing:
            raise ValueError(f"cursor state is missing {', '.join(missing)}")
        n = len(self.examples)
        saved_n = state.get("num_examples", n)
        if saved_n != n:
            raise ValueError(
                f"cursor state was saved for {saved_n} examples but this cursor has {n}; "
                "the dataset changed, so the position cannot be restored exactly"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= n:
            raise ValueError(f"cursor state out of range: epoch={epoch}, position={position} (examples: {n})")
        if self.epochs is not None and epoch >= self.epochs:
            raise ValueError(f"cursor state epoch {epoch} is beyond epochs={self.epochs}")
        self.seed = int(state["seed"])
        self.epoch = epoch
        self.position = position
        self.examples_seen = int(state["examples_seen"])
