"""The adapter of a job's best evaluation (`keep_best:`), kept on the host beside its training state and in its
checkpoints: what its folder holds at its end in place of its last step's weights, as transformers'
`load_best_model_at_end` does. Only a finite value that beats the best so far strictly is kept (transformers
compares so too): a NaN evaluation never replaces a good adapter, and an equal one keeps the earlier."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

BestMetric = Literal["eval_loss", "eval_score"]


@dataclass(frozen=True)
class KeptBest:
    """The best evaluation so far: its metric, step and value, and the adapter's tensors then (PEFT's key names,
    float32 on the host: `adapter_state_dict`)."""

    metric: BestMetric
    step: int
    value: float
    tensors: dict[str, torch.Tensor]

    def describe(self) -> str:
        return f"its best evaluation ({self.metric.replace('_', ' ')} {self.value:.4g})"

    def facts(self) -> dict[str, str | int | float]:
        """What aspen.json and the job's end say of it."""
        return {"metric": self.metric, "step": self.step, "value": self.value}


def improves(metric: BestMetric, value: float | None, best: KeptBest | None) -> bool:
    """Whether an evaluation's `value` of `metric` replaces `best`: finite, and lower (a loss) or higher (a score)
    than the best's."""
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best.value if metric == "eval_loss" else value > best.value
