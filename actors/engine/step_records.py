"""What a job's optimizer steps leave behind, as plain data (no torch): the step in progress
(`StepAccumulator`) and one row of its metrics (`OptimizerStepRecord`). Light to import, so that reading a
checkpoint's state (actors/checkpoint/state.py) needs neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class StepAccumulator:
    """Loss and tokens of the micro-batches of the optimizer step in progress. `loss_sum` sums the target
    tokens' losses, so `loss` is the mean over all the step's target tokens (token-weighted, like its
    gradient)."""

    loss_sum: float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    targets: int = 0
    # a preference or GRPO job's metrics (rewards, margins, ...): sums weighted like the loss, over their weights' sum
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_weights: dict[str, float] = field(default_factory=dict)   # each metric's, of the micro-batches that had it

    def add(self, loss: float, tokens: int, targets: int, metrics: dict[str, float] | None = None) -> None:
        """`loss`: the micro-batch's mean over its `targets` target tokens (a preference job's: over its
        pairs); `metrics`: means over the same, averaged alike."""
        self.count(tokens, targets)
        self.add_loss(loss, targets, metrics)

    def count(self, tokens: int, targets: int) -> None:
        """A micro-batch's sizes, known before its loss is read back (`add_loss` adds that)."""
        self.micro_batches += 1
        self.tokens += tokens
        self.targets += targets

    def add_loss(self, loss: float, targets: int, metrics: dict[str, float] | None = None) -> None:
        """The micro-batch's metrics weigh as its targets, and at least as one: a micro-batch without any (a GRPO
        job's completions all masked as truncated) still reports its rewards and lengths. A metric a micro-batch
        lacks (a reward function that scored none of its completions) is the mean over those that have it."""
        self.loss_sum += loss * targets
        weight = max(targets, 1)
        for name, value in (metrics or {}).items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + value * weight
            self.metric_weights[name] = self.metric_weights.get(name, 0.0) + weight

    @property
    def metrics(self) -> dict[str, float]:
        return {name: total / max(self.metric_weights.get(name, 0.0), 1) for name, total in self.metric_sums.items()}

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.targets, 1)


@dataclass(kw_only=True)
class OptimizerStepRecord:
    """One row of a job's metrics.jsonl."""

    step: int
    loss: float
    tokens: int
    lr: float
    grad_norm: float
    metrics: dict[str, float] = field(default_factory=dict)   # a preference job's (rewards/margins, ...)

    def as_row(self) -> dict:
        return {"step": self.step, "loss": self.loss, "tokens": self.tokens, "lr": self.lr,
                "grad_norm": self.grad_norm, **self.metrics}
