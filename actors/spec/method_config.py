"""The objectives of a job's method beyond sft: `preference:` of a dpo / orpo / cpo job, `grpo:` of a grpo job
(its reward and sampling)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from actors.spec.field_types import Bounds, StrictModel
from actors.spec.user_functions import check_reference


class PreferenceConfig(StrictModel):
    """The preference objective of a `method: dpo`, `orpo` or `cpo` job (as TRL's DPOConfig / ORPOConfig /
    CPOConfig)."""

    beta: Annotated[float, Bounds(0, 1000, low_open=True)] = Field(
        0.1, description="DPO: the temperature of the sigmoid loss (how far the adapter may move from its "
                         "reference: the base, or the job's init_adapter); ORPO: the weight (lambda) of the odds-ratio "
                         "term beside the chosen completion's language-modelling loss; CPO: the temperature of its "
                         "sigmoid loss on the completions' log-probability margin")
    cpo_alpha: Annotated[float, Bounds(0, 1000)] = Field(
        1.0, description="CPO only: the weight of the chosen sequence's language-modelling (NLL) term (TRL's "
                         "cpo_alpha; 0 leaves the preference term alone)")


PREFERENCE_METHODS = ("dpo", "orpo", "cpo")

REWARDS = ("exact_match", "contains", "regex")


class GrpoConfig(StrictModel):
    """The objective of a `method: grpo` job (as TRL's GRPOConfig): each prompt's `num_generations`
    completions sampled with the job's own adapter on its trainer, scored by `reward` (one function or several,
    weighted), and trained on their group-relative advantages."""

    reward: str | list[str] = Field(
        description="exact_match (the completion, stripped, equals the row's target text), contains, regex "
                    "(`pattern` finds the same answer in both), or module:function or file.py:function (a file "
                    "relative to the jobs file), called as function(prompts, completions, rows) -> list of floats "
                    "with rows [{prompt, reference}] (texts), one reward per completion (None where it does not "
                    "apply); or a list of these, whose rewards are summed, weighted by reward_weights (TRL's "
                    "reward_funcs)")
    reward_weights: list[float] | None = Field(
        None, description="the weight of each reward in the list (default: 1 each; TRL's reward_weights)")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="several rewards: their weighted sum made into advantages as scale_rewards "
        "says, or (normalize_then_sum, GDPO) each reward normalized in its group first, then their weighted sum "
        "over the micro-batch's standard deviation (TRL's option)")
    reward_timeout_s: Annotated[float, Bounds(0, 86400, low_open=True)] = Field(
        60.0, description="how long a reward function of the user's may take to score a micro-batch's completions "
                          "(it runs in a process of its own); past it, it is stopped and the job fails saying so")
    pattern: str | None = Field(None, description="regex: the answer's pattern, e.g. '####\\s*(-?[0-9.,]+)'")
    num_generations: Annotated[int, Bounds(2, 256)] = Field(8, description="completions sampled per prompt (G)")
    max_new_tokens: Annotated[int, Bounds(1, 4096)] = Field(
        64, description="the longest completion (it also ends at the tokenizer's EOS); TRL's max_completion_length")
    temperature: Annotated[float, Bounds(0, 100, low_open=True)] = Field(
        1.0, description="sampling temperature; the log-probabilities trained on are taken at it too (as TRL)")
    top_k: Annotated[int, Bounds(0, 10**6)] = Field(0, description="sample among the k likeliest tokens (0: all)")
    top_p: Annotated[float, Bounds(0, 1, low_open=True)] = Field(
        1.0, description="then among the smallest set of tokens whose probability reaches top_p (1: all)")
    min_p: Annotated[float, Bounds(0, 1)] = Field(
        0.0, description="then among the tokens at least min_p times as likely as the likeliest (0: all)")
    beta: Annotated[float, Bounds(0, 1000)] = Field(
        0.0, description="weight of the KL term to the reference: the base with the adapter off, or the job's "
                         "init_adapter (TRL's default 0: none)")
    epsilon: Annotated[float, Bounds(0, 10)] = Field(
        0.2, description="the ratio's clipping range: below 1 - epsilon (and above 1 + epsilon_high) a completion "
                         "token's ratio to its generation's probability stops its gradient")
    epsilon_high: Annotated[float, Bounds(0, 10)] | None = Field(
        None, description="the upper clipping bound's (DAPO's clip-higher, e.g. 0.28; default: epsilon)")
    num_iterations: Annotated[int, Bounds(1, 64)] = Field(
        1, description="optimizer steps each generation is trained for (TRL's num_iterations, mu): the completions "
                       "sampled for one optimizer step's micro-batches are replayed for the next num_iterations - 1 "
                       "steps, their ratio against the probabilities they were sampled at (so clipping acts); an "
                       "epochs budget counts each generation's steps")
    loss_type: Literal["dapo", "grpo"] = Field(
        "dapo", description="dapo: the mean over every completion token of the optimizer step (TRL's default); "
                            "grpo: each completion's token mean, averaged over the completions")
    mask_truncated_completions: bool = Field(
        False, description="a completion that reached max_new_tokens without ending (no EOS) teaches nothing: "
                           "its tokens are left out of the loss (DAPO's overlong filtering; TRL's option)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantages divided by the rewards' standard deviation in the prompt's group, in the "
                             "micro-batch, or not at all")

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value:
                raise ValueError("reward is an empty list: name one reward function or more")
            repeated = sorted({reference for reference in value if value.count(reference) > 1})
            if repeated:
                raise ValueError(f"reward names {', '.join(repeated)} more than once: name each function once "
                                 "and give it a weight in reward_weights")
        for reference in [value] if isinstance(value, str) else value:
            check_reference(reference, "grpo.reward", REWARDS, "function(prompts, completions, rows) -> list of "
                            "floats")
        return value

    @property
    def rewards(self) -> tuple[str, ...]:
        """The job's reward functions, one or several."""
        return (self.reward,) if isinstance(self.reward, str) else tuple(self.reward)

    @property
    def upper_epsilon(self) -> float:
        """The upper clipping range: epsilon_high, else epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def weights(self) -> tuple[float, ...]:
        """Each reward function's weight (1 each unless reward_weights says)."""
        return tuple(self.reward_weights) if self.reward_weights is not None else (1.0,) * len(self.rewards)

    @model_validator(mode="after")
    def _pattern_for_regex(self) -> GrpoConfig:
        if "regex" in self.rewards and not self.pattern:
            raise ValueError("reward regex needs pattern (e.g. '####\\s*(-?[0-9.,]+)')")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} rewards: "
                             "give one weight per reward function, in the order of reward")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {error}") from None
        return self
