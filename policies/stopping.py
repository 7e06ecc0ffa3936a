"""Stop rules: decide from a job's loss history whether further training still pays off.

A rule is a plain object with `decide(history) -> StopDecision | None`; the job actor asks it after
every optimizer step it hears of. `PredictiveRule` fits a power law to the job's eval losses (without an
eval split: its train loss, averaged over windows of `eval_every` steps), predicts the loss at the job's budget and
stops the job when the predicted remaining improvement
is below `min_improvement` (relative) or below `min_delta` (absolute, in loss units) even at the optimistic
end of its uncertainty. A loss that has not beaten its best by at least `min_delta` for `patience`
evaluations stops the job as well (Keras' `min_delta`; an equal loss is no improvement)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

DEFAULT_MIN_DELTA_FRACTION = 0.001
"""`min_delta` when a job gives none: this fraction (0.1%) of the first loss the rule judges (the first
eval loss, or the first train loss where the job has no eval split)."""


class EarlyStopSettings(Protocol):
    """What a job's `early_stop:` gives a stop rule (the job spec's EarlyStopConfig has these)."""

    min_improvement: float
    patience: int
    min_delta: float | None


@dataclass(frozen=True)
class StopDecision:
    step: int
    reason: str


@dataclass
class LossHistory:
    """What a stop rule sees: train losses by optimizer step and eval losses at evaluation steps."""

    train: list[tuple[int, float]] = field(default_factory=list)
    eval: list[tuple[int, float]] = field(default_factory=list)

    def truncate(self, step: int) -> None:
        """Forget everything after `step` (a job resumed from a checkpoint replays those steps)."""
        self.train = [(s, v) for s, v in self.train if s <= step]
        self.eval = [(s, v) for s, v in self.eval if s <= step]

    def smoothed_train(self, every: int) -> list[tuple[int, float]]:
        """The train loss averaged over each window of `every` steps, at the window's last step (a step
        that is a multiple of `every`). A window forgets the losses before it: a moving average would
        carry a fast early drop for many windows and hide a plateau reached soon after it."""
        points, window = [], []
        for step, value in self.train:
            window.append(value)
            if step % every == 0:
                points.append((step, sum(window) / len(window)))
                window = []
        return points


@dataclass(frozen=True)
class Verdict:
    """A job's answer to a trainer's update: stop now, and/or the step at which it is predicted to stop
    (schedulers use it for the job's remaining work)."""

    stop: StopDecision | None = None
    predicted_stop_step: int | None = None


class StopRule(Protocol):
    def decide(self, history: LossHistory) -> StopDecision | None: ...


@dataclass(frozen=True)
class CurveFit:
    """loss(t) = a + b * t^(-c), fitted by least squares (a grid over c, linear in a and b)."""

    a: float
    b: float
    c: float
    residual_std: float

    def __call__(self, step: float) -> float:
        return self.a + self.b * max(step, 1.0) ** (-self.c)


EXPONENTS = np.geomspace(0.02, 3.0, 48)


def fit_power_law(points: list[tuple[int, float]]) -> CurveFit | None:
    if len(points) < 4:
        return None
    t = np.array([max(s, 1) for s, _ in points], dtype=np.float64)
    y = np.array([v for _, v in points], dtype=np.float64)
    best: CurveFit | None = None
    best_sse = float("inf")
    for c in EXPONENTS:
        x = np.stack([np.ones_like(t), t ** (-c)], axis=1)
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        if b < 0:            # rising with training (overfitting): the best non-increasing fit is flat
            a, b = float(np.mean(y)), 0.0
        sse = float(np.sum((x @ np.array([a, b]) - y) ** 2))
        if sse < best_sse:
            best_sse, best = sse, CurveFit(float(a), float(b), float(c), 0.0)
    if best is None:
        return None
    dof = max(len(points) - 3, 1)
    return CurveFit(best.a, best.b, best.c, float(np.sqrt(best_sse / dof)))


@dataclass(frozen=True)
class Prediction:
    now: float            # fitted loss at the latest evaluated step
    final: float          # predicted loss at the job's budget
    final_spread: float   # the 90% quantile of the predicted relative improvement, over bootstrap refits
    improvement: float    # relative: (now - final) / now
    gain_bound: float = float("inf")   # the 90% quantile of the predicted absolute gain (now - final)

    @property
    def gain(self) -> float:
        """The predicted absolute gain from now to the budget, in loss units."""
        return self.now - self.final

    def describe(self, kind: str, step: int, budget: int) -> str:
        return (f"{kind} loss is predicted to go from {self.now:.4g} (step {step}) to {self.final:.4g} at step "
                f"{budget}: {self.improvement:.2%} better (90% bound {self.final_spread:.2%}), "
                f"{self.gain:.3g} lower (90% bound {self.gain_bound:.3g})")


@dataclass(frozen=True)
class MinDelta:
    """The absolute threshold a rule judges with: its value and where it came from (for stop reasons)."""

    value: float
    source: str

    def describe(self) -> str:
        return f"min_delta {self.value:.3g} ({self.source})"


@dataclass(frozen=True)
class PredictiveRule:
    """Fit a power law to the job's eval losses (or its smoothed train loss), predict the loss at the
    job's budget with a residual bootstrap, and stop when even the optimistic (90%) predicted remaining
    improvement is below `min_improvement` (relative) or the optimistic remaining gain is below
    `min_delta` (absolute), after at least `patience` + 3 evaluations and not within the budget's last
    `patience` evaluations (there the remaining improvement is small for any job, even one still
    improving, and stopping would save little). A loss that has not beaten its earlier best by at least
    `min_delta` in the last `patience` evaluations stops too (a plateau, where an equal loss is no
    improvement, or overfitting: the residual bootstrap would read a rise as noise and widen its bound,
    and a rising curve fits the power law only as flat). `min_delta` None: DEFAULT_MIN_DELTA_FRACTION of
    the first loss the rule judges."""

    min_improvement: float
    patience: int
    budget_steps: int
    every: int = 10
    samples: int = 32
    min_delta: float | None = None

    def resolved_min_delta(self, history: LossHistory) -> MinDelta:
        """`min_delta`, or its default from the job's first recorded loss (eval, else train)."""
        if self.min_delta is not None:
            return MinDelta(self.min_delta, "given")
        kind, first = ("eval", history.eval[0][1]) if history.eval else ("train", history.train[0][1])
        return MinDelta(DEFAULT_MIN_DELTA_FRACTION * abs(first),
                        f"{DEFAULT_MIN_DELTA_FRACTION:.1%} of the first {kind} loss {first:.4g}")

    def predict(self, points: list[tuple[int, float]]) -> Prediction | None:
        fit = fit_power_law(points)
        if fit is None:
            return None
        step = points[-1][0]
        now, final = fit(step), fit(self.budget_steps)
        rng = np.random.default_rng(len(points))
        t = [s for s, _ in points]
        fitted = np.array([fit(s) for s in t])
        residuals = np.array([v for _, v in points]) - fitted
        gains, relative = [], []
        for _ in range(self.samples):
            noisy = fitted + rng.choice(residuals, size=len(residuals), replace=True)
            refit = fit_power_law(list(zip(t, noisy.tolist(), strict=True)))
            if refit is not None:
                gain = refit(step) - refit(self.budget_steps)
                gains.append(gain)
                relative.append(gain / max(abs(refit(step)), 1e-12))
        spread = float(np.quantile(relative, 0.9)) if relative else float("inf")
        gain_bound = float(np.quantile(gains, 0.9)) if gains else float("inf")
        return Prediction(now, final, spread, (now - final) / max(abs(now), 1e-12), gain_bound)

    def points(self, history: LossHistory) -> tuple[str, list[tuple[int, float]]]:
        return ("eval", history.eval) if history.eval else ("smoothed train", history.smoothed_train(self.every))

    def predicted_stop_step(self, history: LossHistory) -> int | None:
        """The first step at which the fitted curve's remaining improvement to the budget falls below
        `min_improvement` (relative) or `min_delta` (absolute) (the budget itself if it never does); None
        without enough points."""
        _, points = self.points(history)
        fit = fit_power_law(points) if len(points) >= self.patience + 3 else None
        if fit is None:
            return None
        min_delta = self.resolved_min_delta(history).value
        final = fit(self.budget_steps)
        candidates = np.unique(np.geomspace(max(points[-1][0], 1), self.budget_steps, 64).astype(int))
        for step in candidates:
            now = fit(step)
            if (now - final) / max(abs(now), 1e-12) < self.min_improvement or now - final < min_delta:
                return int(step)
        return self.budget_steps

    def decide(self, history: LossHistory) -> StopDecision | None:
        kind, points = self.points(history)
        if len(points) < self.patience + 3 or points[-1][0] + self.patience * self.every >= self.budget_steps:
            return None      # too little history, or within the budget's last `patience` evaluations
        step = points[-1][0]
        values = [v for _, v in points]
        min_delta = self.resolved_min_delta(history)
        best_before = min(values[:-self.patience])
        if min(values[-self.patience:]) >= best_before - min_delta.value:   # Keras: equal is no improvement
            return StopDecision(step, f"{kind} loss has not improved on its best ({best_before:.4g}) by at least "
                                      f"{min_delta.describe()} for {self.patience} evaluations (step {step}: "
                                      f"{values[-1]:.4g})")
        prediction = self.predict(points)
        if prediction is None:
            return None
        relative_small = max(prediction.improvement, prediction.final_spread) < self.min_improvement
        absolute_small = max(prediction.gain, prediction.gain_bound) < min_delta.value
        if not (relative_small or absolute_small):
            return None
        below = (f"< min_improvement {self.min_improvement:.2%}" if relative_small
                 else f"< {min_delta.describe()}")
        return StopDecision(step, f"{prediction.describe(kind, step, self.budget_steps)} {below}")


def stop_rule_for(early_stop: EarlyStopSettings | None, eval_every: int | None, budget_steps: int) -> StopRule | None:
    """The stop rule of a job with these `early_stop` settings (None: it runs its whole budget)."""
    if early_stop is None:
        return None
    return PredictiveRule(early_stop.min_improvement, early_stop.patience, budget_steps, every=eval_every or 10,
                          min_delta=early_stop.min_delta)
