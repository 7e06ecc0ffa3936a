"""Counting the aten operations a piece of work dispatches (views left out). Where a step is bound by
kernel launches, not arithmetic (a small model on a GPU), each counted operation is about one launch, so
the count tells on any machine what would cost time there: bench/fusion.py prints it per number of
adapters, and a test checks that the grouped LoRA way adds nothing per layer and job."""

from __future__ import annotations

from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPERATIONS = frozenset({
    "alias", "as_strided", "detach", "expand", "permute", "reshape", "select", "slice", "split", "split_with_sizes",
    "squeeze", "t", "transpose", "unbind", "unsqueeze", "view", "_unsafe_view", "_reshape_alias"})


class OperationCounter(TorchDispatchMode):
    """Counts the operations that do work dispatched under it: forward, backward and optimizer alike."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEW_OPERATIONS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_operations(work: Callable[[], object]) -> int:
    """Operations one call of `work` dispatches."""
    with OperationCounter() as counter:
        work()
    return counter.count
