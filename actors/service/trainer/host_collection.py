"""A trainer process's cyclic garbage collection, moved to where the host would wait anyway (`CollectionWindow`).

Python's collector runs a full collection when ten collections of its middle generation have passed: in a
trainer on Ray (32 jobs of a 30-layer model, this project's 2-core CPU, 2026-12-01) one every 2-3 s, each
walking every object the process holds (torch, transformers, Ray, the base's modules: 90-110 ms), at whatever
point of the step the allocation that tipped it came: before the step's first kernel, or between two launches,
where a GPU waits for it. A trainer's own process (`TrainerActor`) hands the full collections to its loop:
the objects alive once the trainer is set up (the libraries and the base, alive as long as it) are set aside
(`gc.freeze`), so that a full collection walks only what came after (15-60 ms there, on the same run); Python's
own full collections are switched off, and the loop runs one where Python would have (`collect_if_due`: the same
count of middle collections) once a step's kernels are queued, while the device runs them, or while it idles.
The young generations stay Python's (a few ms a step in all). Nothing else changes: the same garbage is found,
at about the same pace."""

from __future__ import annotations

import gc

from actors.engine.warmup import settle_garbage_collector

NEVER = 2**31 - 1   # a threshold the middle generation's collections never reach


class CollectionWindow:
    """Full collections at the loop's chosen moments, once `take_over` is called (in a process of the trainer's
    own: the collector's settings are the process's); before that, and after `give_back`, Python's as usual."""

    def __init__(self) -> None:
        self.thresholds: tuple[int, int, int] | None = None   # Python's, while taken over
        self.full_collections = 0   # run here

    def take_over(self) -> None:
        """Collect what is garbage now, set aside what is alive (gc.freeze), and stop Python's own full
        collections (the oldest generation's threshold out of reach); the younger ones stay Python's."""
        if self.thresholds is not None:
            return
        settle_garbage_collector()   # what is garbage collected, the rest set aside (and handed back at exit)
        self.thresholds = gc.get_threshold()
        young, middle, _ = self.thresholds
        gc.set_threshold(young, middle, NEVER)

    def collect_if_due(self) -> bool:
        """Run a full collection where Python's own rule would have by now (as many middle collections as its
        oldest threshold); whether one ran. Nothing before `take_over`."""
        if self.thresholds is None or gc.get_count()[2] < self.thresholds[2]:
            return False
        gc.collect()
        self.full_collections += 1
        return True

    def give_back(self) -> None:
        """Python's thresholds again, and the set-aside objects back in its generations."""
        if self.thresholds is None:
            return
        gc.set_threshold(*self.thresholds)
        gc.unfreeze()
        self.thresholds = None
