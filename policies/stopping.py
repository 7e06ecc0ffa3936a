"""Stop rules: decide from a job's loss history whether further training still pays off.

A rule is a plain object with `decide(history) -> StopDecision | None`; the job actor asks it after
every optimizer step it hears of. `PlateauRule` stops a job whose last `patience` evaluations improved on
the best loss before them by less than `min_improvement` (relative); without an eval split it watches
the train loss, smoothed by an exponential moving average and sampled every `eval_every` steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from actors.engine.spec import EarlyStopConfig, JobSpec


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

    def smoothed_train(self, every: int, decay: float = 0.9) -> list[tuple[int, float]]:
        """The train loss's exponential moving average, sampled every `every` steps."""
        points, average = [], None
        for step, value in self.train:
            average = value if average is None else decay * average + (1 - decay) * value
            if step % every == 0:
                points.append((step, average))
        return points


class StopRule(Protocol):
    def decide(self, history: LossHistory) -> StopDecision | None: ...


@dataclass(frozen=True)
class PlateauRule:
    min_improvement: float
    patience: int
    every: int = 10  # sampling of the smoothed train loss when there are no eval losses

    def decide(self, history: LossHistory) -> StopDecision | None:
        kind, points = ("eval", history.eval) if history.eval else ("smoothed train", history.smoothed_train(self.every))
        if len(points) <= self.patience:
            return None
        best_before = min(value for _, value in points[:-self.patience])
        recent_best = min(value for _, value in points[-self.patience:])
        gain = (best_before - recent_best) / max(abs(best_before), 1e-12)
        if gain >= self.min_improvement:
            return None
        step = points[-1][0]
        return StopDecision(step, f"{kind} loss plateaued: the last {self.patience} evaluations (up to step {step}) "
                                  f"improved on {best_before:.4f} by {gain:.2%} < min_improvement "
                                  f"{self.min_improvement:.2%}")


def stop_rule_for(spec: JobSpec) -> StopRule | None:
    config: EarlyStopConfig | None = spec.early_stop
    if config is None:
        return None
    return PlateauRule(config.min_improvement, config.patience, every=spec.eval_every or 10)
