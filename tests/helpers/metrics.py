"""User metric functions for eval_generate tests (imported by name, as a user's `module:function`)."""

from __future__ import annotations

CALLS: list[tuple[str, dict]] = []   # every (prediction, row) `recorded` was called with, in order


def recorded(prediction: str, row: dict) -> float:
    """Records its call; scores a text by its length (so that different continuations score differently)."""
    CALLS.append((prediction, dict(row)))
    return (len(prediction) % 7) / 6


def broken(prediction: str, row: dict) -> float:
    raise KeyError("answer")
