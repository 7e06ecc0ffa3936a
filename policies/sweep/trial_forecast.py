"""The predictive rule a sweep stops a trial by: its forecast final objective cannot beat the best trial's.

Each trial's objectives (its eval losses as they come) are fitted with aspen's loss-curve model
(`policies/stopping.py`: loss(t) = a + b·t^-c) and extrapolated to the trials' `max_steps`. Once some trial
has finished (its final objective is the best known), a trial is stopped when even the optimistic end of its
forecast is not below the best final by `min_delta`: training it further could not produce the sweep's best
trial. The optimistic end is the 10% quantile of the final loss over refits of the curve to its fitted values
plus Gaussian noise of the fit's residual deviation (its 3 parameters taken out: sqrt(SSE / (n - 3))), and
never above the trial's best so far. A resampling of the residuals themselves (what a job's own stop rule
uses) is too sure of itself with few points: 3 parameters on 4 points leave residuals near zero; on planted
curves with 2% noise it stopped 9 of 200 trials that would have beaten the best by 8%, the Gaussian one with
5 points none (and every clearly worse trial, at its 5th point: tests/unit/test_trial_forecast.py). A trial
needs `min_points` objectives (default 5; 4 at least) before it is judged; trials are judged only against a
result, never against another forecast. Objectives are minimised (losses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from policies.stopping import fit_power_law


@dataclass(frozen=True)
class ForecastDecision:
    stop: bool
    reason: str
    optimistic_final: float | None = None   # the forecast's optimistic final objective (None: not judged)


@dataclass
class TrialForecast:
    max_steps: int
    min_delta: float = 0.0
    min_points: int = 5
    samples: int = 64
    points: dict[str, list[tuple[int, float]]] = field(default_factory=dict, init=False)
    finals: dict[str, float] = field(default_factory=dict, init=False)   # finished trials' final objectives

    def __post_init__(self) -> None:
        if self.min_points < 4:
            raise ValueError(f"stopping.predictive.min_points: {self.min_points}; the curve has 3 parameters, give "
                             "at least 4")
        if self.min_delta < 0:
            raise ValueError(f"stopping.predictive.min_delta: {self.min_delta}; give 0 or more (loss units)")

    def finished(self, trial: str, objective: float | None) -> None:
        """A trial trained to its end (completed) with this final objective: the best to beat, if lowest."""
        if objective is not None and not math.isnan(objective):
            self.finals[trial] = objective

    def report(self, trial: str, step: int, objective: float) -> ForecastDecision:
        """The decision on `trial` after its objective `objective` at `step`."""
        if math.isnan(objective):
            return ForecastDecision(True, f"objective is NaN at step {step}: the trial diverged")
        points = self.points.setdefault(trial, [])
        points[:] = [p for p in points if p[0] < step] + [(step, objective)]   # a resumed trial replays steps
        if step >= self.max_steps:
            self.finished(trial, objective)
            return ForecastDecision(False, f"reached max_steps {self.max_steps}")
        rivals = {name: value for name, value in self.finals.items() if name != trial}
        if not rivals or len(points) < self.min_points:
            return ForecastDecision(False, "no finished trial to beat yet" if not rivals else
                                    f"{len(points)} of {self.min_points} objectives to forecast from")
        best_name, best = min(rivals.items(), key=lambda item: item[1])
        forecast = self.forecast(points)
        if forecast is None:
            return ForecastDecision(False, "no forecast")
        final, optimistic = forecast
        if optimistic > best - self.min_delta:
            return ForecastDecision(True, f"forecast {final:.6g} at step {self.max_steps} (at best "
                                          f"{optimistic:.6g}, 90% bound) cannot beat {best_name}'s {best:.6g} by "
                                          f"min_delta {self.min_delta:g}", optimistic)
        return ForecastDecision(False, f"may beat {best_name}: forecast at best {optimistic:.6g}", optimistic)

    def forecast(self, points: list[tuple[int, float]]) -> tuple[float, float] | None:
        """(the fitted final objective, its optimistic end): module docstring."""
        fit = fit_power_law(points)
        if fit is None:
            return None
        steps = [step for step, _ in points]
        fitted = np.array([fit(step) for step in steps])
        rng = np.random.default_rng(len(points))   # the same points, the same decision (a restored sweep's too)
        finals = []
        for _ in range(self.samples):
            refit = fit_power_law(list(zip(steps, (fitted + rng.normal(0.0, fit.residual_std, len(steps))).tolist(),
                                           strict=True)))
            if refit is not None:
                finals.append(refit(self.max_steps))
        optimistic = float(np.quantile(finals, 0.1)) if finals else float("-inf")
        return fit(self.max_steps), min(optimistic, min(value for _, value in points))

    def state_dict(self) -> dict:
        return {"points": {t: [list(p) for p in ps] for t, ps in self.points.items()}, "finals": dict(self.finals)}

    def load_state_dict(self, state: dict) -> None:
        self.points = {t: [(int(s), float(v)) for s, v in ps] for t, ps in state["points"].items()}
        self.finals = {t: float(v) for t, v in state["finals"].items()}
