"""A GRPO job's rewards, as TRL's GRPOTrainer makes them of its `reward_funcs`: each reward function called on a
micro-batch's completions (`reward_scores`), their weighted sum turned into group-relative advantages
(`group_scores`), and the metrics TRL logs of them (`reward_metrics`).

A function is called as function(prompts, completions, rows) and returns one number per completion, or None
where it does not apply (TRL's convention, e.g. a format check only some rows ask for). A completion's reward is
the weighted sum of the functions that scored it (TRL's nansum); one that no function scored is unscorable: it is
left out of its group's mean and standard deviation and its advantage is 0. `sum_then_normalize` (TRL's default)
takes the advantage of the summed reward (minus its group's mean, over the group's standard deviation + 1e-4, or
the micro-batch's, or unscaled: `scale_rewards`); `normalize_then_sum` (GDPO) normalizes each function's scores
in their group first, then their weighted sum over the micro-batch. Standard deviations are Bessel-corrected, NaN
for fewer than two values (TRL's `nanstd`). What TRL calls the batch is here the job's micro-batch.

A user's function runs in a process of its own with a deadline (actors/engine/user_calls.py).
A reward that raises, returns a count other than one per completion, a non-number or a number that is not
finite, runs past `reward_timeout_s` or ends its process is a `RewardError` naming it: that job fails, the others
go on (the trainer loop)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from actors.engine.generation_eval import metric_function
from actors.engine.user_calls import CallFailed, FunctionWorker
from actors.spec.evaluation_config import GenerationEval
from actors.spec.method_config import REWARDS, GrpoConfig
from actors.spec.user_functions import split_reference

Reward = Callable[[list[str], list[str], list[dict]], Sequence[float | None]]


class RewardError(ValueError):
    """A GRPO job's reward function raised or returned something other than one finite number (or None) per
    completion."""


def reward_function(reference: str, config: GrpoConfig, worker: FunctionWorker | None) -> Reward:
    """The reward `reference` names as function(prompts, completions, rows) -> one float per completion: a
    built-in here, a user's in `worker` (ValueError without one)."""
    if reference in REWARDS:
        metric = metric_function(GenerationEval(metric=reference, pattern=config.pattern))
        return lambda prompts, completions, rows: [metric(c, row) for c, row in zip(completions, rows, strict=True)]
    if worker is None:
        raise ValueError(f"grpo.reward '{reference}' is a function of the user's: it runs in a FunctionWorker "
                         "(actors/engine/user_calls.py)")

    def called(prompts: list[str], completions: list[str], rows: list[dict]) -> list[float | None]:
        try:
            return worker.call(reference, "grpo.reward", "batch", [prompts, completions, rows],
                               config.reward_timeout_s)
        except CallFailed as failed:
            raise RewardError(_failure(reference, failed, completions, config.reward_timeout_s)) from None

    return called


def _failure(reference: str, failed: CallFailed, completions: list[str], timeout_s: float) -> str:
    named = f"grpo.reward '{reference}'"
    if failed.kind == "load":
        return failed.message
    if failed.kind == "raised":
        return (f"{named} raised {failed.message} (on completions such as {completions[0][:80]!r}); it must return "
                "a number (or None) for any text")
    if failed.kind == "value":
        return f"{named} returned a reward that is neither a number nor None ({failed.message})"
    if failed.kind == "timeout":
        return (f"{named} did not return within {timeout_s:g} s (grpo.reward_timeout_s) on {len(completions)} "
                "completions and was stopped; make it faster or raise grpo.reward_timeout_s")
    return (f"{named}: {failed.message} while scoring {len(completions)} completions; the job cannot be scored "
            "until the function is fixed")


def reward_names(config: GrpoConfig) -> list[str]:
    """Each reward's name in the metrics (`rewards/<name>/mean`): a built-in's own, a function's name (as TRL names
    a callable), its whole reference where two functions share a name."""
    short = [reference if reference in REWARDS else split_reference(reference)[1] for reference in config.rewards]
    return [name if short.count(name) == 1 else reference for name, reference in zip(short, config.rewards,
                                                                                      strict=True)]


def scored(reward: Reward, reference: str, prompts: list[str], completions: list[str], rows: list[dict]
           ) -> list[float]:
    """One reward function's score of each completion, NaN where it returned None; RewardError where it raised or
    returned other than one finite number or None per completion."""
    try:
        values = list(reward(prompts, completions, rows))
    except RewardError:
        raise
    except Exception as error:
        raise RewardError(f"grpo.reward '{reference}' raised {type(error).__name__}: {error} (on completions such "
                          f"as {completions[0][:80]!r}); it must return a number (or None) for any text") from error
    if len(values) != len(completions):
        raise RewardError(f"grpo.reward '{reference}' returned {len(values)} rewards for {len(completions)} "
                          "completions; it must return one per completion")
    try:
        numbers = [math.nan if value is None else float(value) for value in values]
    except (TypeError, ValueError) as error:
        raise RewardError(f"grpo.reward '{reference}' returned a reward that is neither a number nor None "
                          f"({error})") from None
    if any(math.isinf(number) or (math.isnan(number) and value is not None)
           for number, value in zip(numbers, values, strict=True)):
        raise RewardError(f"grpo.reward '{reference}' returned a reward that is not finite ({values[:8]}); return "
                          "None where it does not apply")
    return numbers


def reward_scores(config: GrpoConfig, prompts: list[str], completions: list[str], rows: list[dict],
                  worker: FunctionWorker | None) -> torch.Tensor:
    """(completions, reward functions): each function's score of each completion (float64, NaN where it returned
    None); the user's functions run in `worker`."""
    columns = [scored(reward_function(reference, config, worker), reference, prompts, completions, rows)
               for reference in config.rewards]
    return torch.tensor(columns, dtype=torch.float64).T.reshape(len(completions), len(columns))


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, Bessel-corrected; NaN where fewer than two."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    squares = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True)
    variance = torch.where(count > 1, squares / (count - 1).clamp_min(1), torch.full_like(squares, math.nan))
    deviation = variance.sqrt()
    if dim is None:
        return deviation.reshape(())
    return deviation if keepdim else deviation.squeeze(dim)


@dataclass(frozen=True)
class GroupScores:
    """A micro-batch's completions (prompts, G): their rewards (the weighted sums; NaN: unscorable), advantages,
    and whether the spread their advantage is scaled by is zero (TRL's `frac_reward_zero_std` counts them)."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    zero_spread: torch.Tensor


def _weighted_sum(scores: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
    total = (scores * weights).nansum(dim=-1)
    return total.masked_fill(unscorable, math.nan)


def group_scores(config: GrpoConfig, scores: torch.Tensor) -> GroupScores:
    """The advantages of `scores` (prompts, G, reward functions; NaN where a function did not apply), as TRL's
    GRPOTrainer computes them (the module's docstring)."""
    weights = torch.tensor(config.weights, dtype=scores.dtype)
    unscorable = torch.isnan(scores).all(dim=-1)
    rewards = _weighted_sum(scores, weights, unscorable)
    if config.multi_objective_aggregation == "normalize_then_sum":
        normalized = (scores - torch.nanmean(scores, dim=1, keepdim=True)) / (nanstd(scores, 1, keepdim=True) + 1e-4)
        combined = _weighted_sum(normalized, weights, unscorable)
        spread = nanstd(combined).expand_as(combined)
        advantage = (combined - torch.nanmean(combined)) / (spread + 1e-4)
    else:
        centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
        spread = (nanstd(rewards) if config.scale_rewards == "batch" else nanstd(rewards, 1, keepdim=True)
                  ).expand_as(rewards)
        advantage = centred if config.scale_rewards == "none" else centred / (spread + 1e-4)
    return GroupScores(rewards, torch.nan_to_num(advantage, nan=0.0), torch.isclose(spread, torch.zeros_like(spread)))


def reward_metrics(config: GrpoConfig, scores: torch.Tensor) -> dict[str, float]:
    """What TRL logs of a batch's rewards, here of a micro-batch's `scores` (prompts, G, functions): each function's
    `rewards/<name>/mean` and `/std` over the completions it scored, `reward` and `reward_std` (the weighted sums'
    mean and standard deviation over the scorable completions) and `frac_reward_zero_std` (the share of completions
    whose advantage's spread is zero: their group, or the micro-batch, all scored alike; they teach nothing). A
    metric without a value (no completion scored, one for a deviation) is left out."""
    metrics: dict[str, float] = {}

    def put(name: str, value: torch.Tensor) -> None:
        if not torch.isnan(value):
            metrics[name] = float(value)

    flat = scores.reshape(-1, scores.shape[-1])
    for name, column in zip(reward_names(config), flat.T, strict=True):
        put(f"rewards/{name}/mean", torch.nanmean(column))
        put(f"rewards/{name}/std", nanstd(column))
    groups = group_scores(config, scores)
    put("reward", torch.nanmean(groups.rewards))
    put("reward_std", nanstd(groups.rewards))
    metrics["frac_reward_zero_std"] = float(groups.zero_spread.to(torch.float64).mean())
    return metrics
