"""`minpad`: the ASPEN paper's OptimalBatch. Where jobs share padded rows (layout `padded_fused`, mLoRA's,
where every row is padded to the step's longest sequence), which jobs' micro-batches go into one step
decides how much of it is padding. MinPad picks, before every step, the set of jobs that wastes least:

- the job that has waited longest for a step always joins (so no job starves: each waits at most as
  many steps as there are jobs), then
- of the other jobs, the subset (all subsets up to `EXHAUSTIVE_UP_TO` candidates, greedily beyond) that
  maximises effective tokens − `padding_weight` × the padding that fusing causes, within the step's token
  budget and the trainer's memory budget. The padding fusing causes is the step's padding beyond what each
  job's rows would have padded to its own longest row (which no grouping avoids).

With `padding_weight` 4, a job joins when the padding it causes is under a quarter of its real tokens; a
short job is not padded to a long job's length, and long jobs go together. In the `packed` layout there
is no padding and MinPad takes as many jobs as fit, like round-robin.
Admission, ordering and moves are the `adaptive` policy's."""

from __future__ import annotations

from collections.abc import Callable
from itertools import combinations

from policies.base import NextBatch
from policies.moves import MoveRule
from policies.ordering import AdaptivePolicy

EXHAUSTIVE_UP_TO = 10


class MinPadPolicy(AdaptivePolicy):
    name = "minpad"

    def __init__(self, aging_s: float = 3600.0, preempt_ratio: float = 4.0, priority_weight: float = 4.0,
                 padding_weight: float = 4.0, moves: MoveRule | None = MoveRule()):
        super().__init__(aging_s, preempt_ratio, priority_weight, moves)
        self.padding_weight = padding_weight

    def compose_step(self, batches: list[NextBatch], cost: Callable[[list[NextBatch]], int], step_tokens: int,
                     fits: Callable[[list[NextBatch]], bool]) -> list[str]:
        if not batches:
            return []
        anchor = max(batches, key=lambda b: b.waited)     # the first of the longest-waiting (stable order)
        others = [b for b in batches if b is not anchor]

        def score(chosen: list[NextBatch]) -> float | None:
            total = cost(chosen)
            if total > step_tokens or not fits(chosen):
                return None
            effective = sum(b.tokens for b in chosen)
            own_padding = sum(max(b.lengths) * len(b.lengths) - b.tokens for b in chosen)
            return effective - self.padding_weight * (total - effective - own_padding)

        alone = score([anchor])
        best, best_score = [anchor], alone if alone is not None else float("-inf")
        if len(others) <= EXHAUSTIVE_UP_TO:
            for size in range(1, len(others) + 1):
                for subset in combinations(others, size):
                    chosen = [anchor, *subset]
                    value = score(chosen)
                    if value is not None and value > best_score:
                        best, best_score = chosen, value
        else:   # greedy: add the job that raises the score most while one does
            remaining = list(others)
            while remaining:
                scored = [(score([*best, b]), b) for b in remaining]
                scored = [(v, b) for v, b in scored if v is not None and v > best_score]
                if not scored:
                    break
                best_score, pick = max(scored, key=lambda pair: pair[0])
                best.append(pick)
                remaining.remove(pick)
        return [b.job for b in best]
