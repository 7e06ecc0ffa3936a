"""How a job is judged while it trains: a generation metric at each evaluation (`eval_generate:`) and the
early stop (`early_stop:`)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from actors.spec.field_types import Bounds, StrictModel
from actors.spec.user_functions import check_reference


class EarlyStopConfig(StrictModel):
    """Stop a job once further training stops paying off: a power law fitted to its eval losses (or its
    smoothed train loss where it has no eval split) predicts less than `min_improvement` (relative) or less
    than `min_delta` (absolute) from now to the end of its budget, or the loss has not beaten its best by
    at least `min_delta` for `patience` evaluations; judged after at least `patience` + 3 evaluations, and never
    within the budget's last `patience` evaluations (from step budget - `patience` x `eval_every` on: there the
    remaining improvement is small for any job), so a budget of at most (2 x `patience` + 3) x `eval_every` steps is
    never stopped early (`eval_every` null: 10)."""

    min_improvement: Annotated[float, Bounds(0, 100)] = Field(
        0.01, description="the relative loss improvement still worth the rest of the budget (0.01: 1%)")
    min_delta: Annotated[float, Bounds(0, 1e6)] | None = Field(
        None, description="the absolute loss improvement (in loss units) that counts: a loss not lower than its "
                          "best by more than this is no improvement (an equal one neither), and a predicted "
                          "remaining gain below it stops the job (null: 0.1% of the job's first recorded loss, "
                          "its first eval loss or, without an eval split, its first train loss; the stop "
                          "reason shows the value used)")
    patience: Annotated[int, Bounds(1, 10_000)] = Field(
        3, description="evaluations without enough improvement before stopping; none is judged within the budget's "
                       "last `patience` evaluations")


GENERATION_METRICS = ("exact_match", "contains", "regex")


class GenerationEval(StrictModel):
    """A generation metric at each evaluation: the adapter continues each held-out row's prompt greedily
    (its trainer, between steps, batched over adapters) and the continuation is scored against the row's
    target text; the evaluation's score is the mean over the rows (higher is better)."""

    metric: str = Field(description="exact_match (the stripped texts are equal), contains (the target text is in "
                                    "the continuation), regex (`pattern` finds the same answer in both: its first "
                                    "group, or the whole match), or module:function or file.py:function (a file "
                                    "relative to the jobs file), called as function(prediction, row) -> float with "
                                    "row {prompt, reference} (texts)")
    pattern: str | None = Field(None, description="regex: the answer's pattern, e.g. '####\\s*(-?[0-9.,]+)'")
    max_new_tokens: Annotated[int, Bounds(1, 4096)] = Field(64, description="the longest continuation (it also "
                                                                          "ends at the tokenizer's EOS)")
    rows: Annotated[int, Bounds(1, 10**6)] | None = Field(None, description="score the first this many eval rows "
                                                                           "(null: all of them)")
    timeout_s: Annotated[float, Bounds(0, 86400, low_open=True)] = Field(
        60.0, description="how long a metric function of the user's may take to score an evaluation's rows (it runs "
                          "in a process of its own); past it, it is stopped and the job fails saying so")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        return check_reference(value, "eval_generate.metric", GENERATION_METRICS, "function(prediction, row) -> "
                               "float")

    @model_validator(mode="after")
    def _pattern_with_regex(self) -> GenerationEval:
        if self.metric == "regex":
            if not self.pattern:
                raise ValueError("metric regex needs `pattern` (the answer's regular expression)")
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {error}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern applies to metric regex, not {self.metric}; remove it")
        return self
