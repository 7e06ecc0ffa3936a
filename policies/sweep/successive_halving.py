"""Asynchronous successive halving (ASHA; Li and others, 2020): the rule a sweep stops its weak trials by.

Rungs lie at `grace_steps * reduction**k` optimizer steps (k = 0, 1, ... up to `max_steps`). When a trial
first reports an objective at or past a rung it has not been judged at, it is judged there against every
result recorded at that rung so far: it goes on if it is within the best `1/reduction` of them (at or
better than their `1 - 1/reduction` quantile, linearly interpolated), else it stops; its result is then
recorded at that rung. The first trial at a rung always goes on. Trials are never paused, so a slot freed by
a stopped trial is taken by the next one at once (the "asynchronous" of ASHA).

The decisions are Ray Tune's `ASHAScheduler` (one bracket, `stop_last_trials`) for the same results in the
same order, tested against it (tests/unit/test_successive_halving.py), except that a trial reaching
`max_steps` is not "stopped" here: it completes (and is not judged at a rung there). A NaN objective is a
diverged trial: stopped at once, and not recorded (Ray Tune's comparison lets it go on). Objectives are
minimised (`mode="min"`: losses) or maximised (`mode="max"`: exact match, a user metric).

Sweeps (actors/service/sweeps/sweep_run.py) drive it: each trial's objective is reported at its rungs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class HalvingDecision:
    stop: bool
    rung: int | None           # the rung's step the trial was judged at (None: no rung reached anew)
    cutoff: float | None       # the objective a trial had to reach there (None: the first at the rung)
    reason: str


@dataclass
class SuccessiveHalving:
    grace_steps: int
    max_steps: int
    reduction: float = 3.0
    mode: Literal["min", "max"] = "min"
    recorded: dict[int, dict[str, float]] = field(default_factory=dict, init=False)   # rung step -> trial -> score

    def __post_init__(self) -> None:
        if self.grace_steps < 1:
            raise ValueError(f"stopping.asha.grace_steps: {self.grace_steps}; give at least 1 step")
        if self.max_steps < self.grace_steps:
            raise ValueError(f"stopping.asha.grace_steps: {self.grace_steps} is past the trials' max_steps "
                             f"{self.max_steps}; give a grace period of fewer steps")
        if not self.reduction > 1:
            raise ValueError(f"stopping.asha.reduction: {self.reduction}; give a factor above 1 (3 keeps a third "
                             "of the trials at each rung)")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode: {self.mode!r}; give 'min' (a loss) or 'max' (a score)")
        count = int(np.log(self.max_steps / self.grace_steps) / np.log(self.reduction) + 1)
        self.rungs = [self.grace_steps * self.reduction ** k for k in range(count)]
        self.recorded = {index: {} for index in range(count)}

    def report(self, trial: str, step: int, objective: float) -> HalvingDecision:
        """The decision on `trial`'s `objective` after `step` optimizer steps."""
        if math.isnan(objective):
            return HalvingDecision(True, None, None, f"objective is NaN at step {step}: the trial diverged")
        if step >= self.max_steps:   # trained to the end: nothing left to save (Ray Tune stops it there too)
            return HalvingDecision(False, None, None, f"reached max_steps {self.max_steps}")
        score = -objective if self.mode == "min" else objective   # higher is better from here on
        for index in reversed(range(len(self.rungs))):
            rung, recorded = self.rungs[index], self.recorded[index]
            if step < rung or trial in recorded:
                continue
            cutoff = float(np.nanpercentile(list(recorded.values()), (1 - 1 / self.reduction) * 100)) \
                if recorded else None
            recorded[trial] = score
            shown_cutoff = None if cutoff is None else (-cutoff if self.mode == "min" else cutoff)
            if cutoff is not None and score < cutoff:
                return HalvingDecision(True, _step(rung), shown_cutoff,
                                       _stop_reason(objective, step, shown_cutoff, len(recorded) - 1, _step(rung),
                                                    self.reduction, self.mode))
            return HalvingDecision(False, _step(rung), shown_cutoff, f"kept at step {_step(rung)}")
        return HalvingDecision(False, None, None, "no new rung")


FRACTIONS = {2: "half", 3: "third", 4: "quarter"}


def _stop_reason(objective: float, step: int, cutoff: float, judged: int, rung: int, reduction: float,
                 mode: str) -> str:
    """Why a trial stops, in words that fit the numbers: its objective, the cut-off it missed and where that
    came from (the trials judged at the same rung before it; ASHA keeps the best 1/reduction of them)."""
    worse = "higher" if mode == "min" else "lower"
    kept = FRACTIONS.get(int(reduction)) if float(reduction).is_integer() else None
    kept = f"the best {kept}" if kept else f"the best 1/{reduction:g}"
    if judged == 1:
        source = f"the objective of the one trial judged at step {rung} before it (asha keeps {kept})"
    else:
        source = f"the cut-off for {kept} of the {judged} trials judged at step {rung} before it"
    return f"objective {objective:.4g} at step {step} is {worse} than {cutoff:.4g}, {source}"


def _step(rung: float) -> int:
    return math.ceil(rung)
