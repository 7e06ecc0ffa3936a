"""A GRPO job's rewards (actors/engine/grpo_rewards.py) against TRL's GRPOTrainer: for the same completion texts
and reward functions (several, weighted, some returning None where they do not apply), the advantages and the
reward metrics equal those TRL's `_generate_and_score_completions` makes (its generation replaced by the fixed
completions), for each aggregation and reward scaling; hand-computed group-relative advantages; a reward that
returns a non-finite number fails its job naming it; the spec's checks of several rewards."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from actors.engine.grpo_rewards import RewardError, group_scores, reward_metrics, reward_scores
from actors.engine.user_calls import FunctionWorker
from actors.spec.method_config import GrpoConfig
from tests.helpers import rewards as helpers
from tests.helpers.models import tiny_model
from tests.helpers.peft_reference import peft_config

G = 4
PROMPTS = ["add 3 and 4", "say seven", "count to three", "skip me"]
REFERENCES = ["7", "7 7", "1 2 3", "skip"]
COMPLETIONS = [["7", "3 4", "7 7 1", "9"],        # sevens vary, lengths vary
               ["7 7", "7 7", "7 7", "7 7"],      # alike: a zero spread
               ["", "1 2 3", "7", ""],            # two empty: shorter_if_said scores two of four
               ["7", "8", "", "7 7"]]             # reference "skip": the *_if_* rewards do not apply
EPS32 = torch.finfo(torch.float32).eps
WORKER = FunctionWorker()   # the user's functions' process, as a trainer's


def _trl_form(function):
    """A reward function of aspen's form (prompts, completions, rows) as TRL calls one (keyword arguments, the
    dataset's columns as lists), under the same name (TRL names its metrics by it)."""
    @functools.wraps(function)
    def called(prompts, completions, reference, **_):
        rows = [{"prompt": p, "reference": r} for p, r in zip(prompts, reference, strict=True)]
        return function(prompts, completions, rows)
    return called


def _trl_scored(tiny_tokenizer, tmp_path, monkeypatch, config: GrpoConfig, functions) -> tuple[torch.Tensor, dict]:
    """TRL's advantages and logged metrics for the fixed completions."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = len(PROMPTS) * G
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=rows, num_generations=G, report_to=[],
                      use_cpu=True, max_completion_length=8, bf16=False, reward_weights=list(config.weights),
                      scale_rewards=config.scale_rewards,
                      multi_objective_aggregation=config.multi_objective_aggregation)
    trainer = GRPOTrainer(model=tiny_model("llama"), reward_funcs=[_trl_form(f) for f in functions], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x", "reference": "y"}] * rows),
                          processing_class=tiny_tokenizer, peft_config=peft_config())
    texts = [text for group in COMPLETIONS for text in group]
    generated = ([[5, 6, 7]] * rows, [[8 + i % 5, 2] for i in range(rows)], None, texts, None, {}, None, None)
    monkeypatch.setattr(trainer, "_generate", lambda prompts: generated)
    trainer.model.train()
    inputs = [{"prompt": p, "reference": r} for p, r in zip(PROMPTS, REFERENCES, strict=True) for _ in range(G)]
    output = trainer._generate_and_score_completions(inputs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()
               if name.startswith(("reward", "frac_reward"))}
    return output["advantages"].double().view(len(PROMPTS), G), metrics


def _aspen_scored(config: GrpoConfig) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    rows = [{"prompt": p, "reference": r} for p, r in zip(PROMPTS, REFERENCES, strict=True) for _ in range(G)]
    texts = [text for group in COMPLETIONS for text in group]
    scores = reward_scores(config, [row["prompt"] for row in rows], texts, rows, WORKER).view(len(PROMPTS), G, -1)
    return group_scores(config, scores).advantages, reward_metrics(config, scores), scores


def _float32_bound(scores: torch.Tensor, weights: tuple[float, ...], spread_floor: float) -> float:
    """How far TRL's float32 arithmetic can put an advantage from the float64 one: the scores rounded to float32
    and each sum, mean and deviation over at most all the micro-batch's completions (n) adding n + 4 roundings of
    the largest weighted reward's size, the difference then divided by the smallest spread that divides one
    (+1e-4), and the normalize-then-sum route doing that twice."""
    n = scores.shape[0] * scores.shape[1]
    largest = float(torch.nan_to_num(scores.abs(), nan=0.0).max()) * sum(abs(w) for w in weights) + 1.0
    return 2 * (n + 4) * EPS32 * largest / spread_floor * (largest / spread_floor + 1)


CASES = [
    pytest.param((helpers.sevens, helpers.shorter), (1.0, 0.5), "sum_then_normalize", "group", id="sum-group"),
    pytest.param((helpers.sevens, helpers.shorter), (1.0, -2.0), "sum_then_normalize", "batch", id="sum-batch"),
    pytest.param((helpers.sevens, helpers.shorter), (0.5, 1.0), "sum_then_normalize", "none", id="sum-none"),
    pytest.param((helpers.sevens_if_asked, helpers.shorter_if_said), (2.0, 1.0), "sum_then_normalize", "group",
                 id="none-returned-group"),
    pytest.param((helpers.sevens_if_asked, helpers.shorter_if_said), (1.0, 3.0), "sum_then_normalize", "batch",
                 id="none-returned-batch"),
    pytest.param((helpers.sevens_if_asked, helpers.shorter_if_said, helpers.sevens), (1.0, 1.0, 0.25),
                 "normalize_then_sum", "group", id="normalize-then-sum"),
]


@pytest.mark.parametrize(("functions", "weights", "aggregation", "scale"), CASES)
def test_advantages_and_reward_metrics_equal_trls(tiny_tokenizer, tmp_path, monkeypatch, functions, weights,
                                                  aggregation, scale):
    config = GrpoConfig(reward=[f"tests.helpers.rewards:{f.__name__}" for f in functions],
                        reward_weights=list(weights), multi_objective_aggregation=aggregation, scale_rewards=scale,
                        num_generations=G)
    expected, trl_metrics = _trl_scored(tiny_tokenizer, tmp_path, monkeypatch, config, functions)
    advantage, metrics, scores = _aspen_scored(config)
    bound = _float32_bound(scores, weights, 1e-4 + min([1.0, *_spreads(scores, config)]))
    difference = float((advantage - expected).abs().max())
    print(f"{aggregation}/{scale}: max |advantage - TRL's| {difference:.2e} (bound {bound:.2e}); "
          f"{int((advantage != 0).sum())} of {advantage.numel()} advantages non-zero")
    assert difference <= bound
    assert (advantage != 0).sum() >= 6   # the comparison is not one of zeros
    finite = {name: value for name, value in trl_metrics.items() if not math.isnan(value)}
    assert set(metrics) == set(finite), (metrics, trl_metrics)   # TRL's NaN ones (nothing scored) left out here
    for name, value in finite.items():
        assert metrics[name] == pytest.approx(value, rel=bound, abs=bound), name


def _spreads(scores: torch.Tensor, config: GrpoConfig) -> list[float]:
    """The non-zero spreads an advantage is divided by (the group's or the micro-batch's), in float64."""
    from actors.engine.grpo_rewards import nanstd

    weights = torch.tensor(config.weights, dtype=torch.float64)
    summed = (scores * weights).nansum(-1).masked_fill(torch.isnan(scores).all(-1), math.nan)
    values = [nanstd(summed), *nanstd(summed, 1)]
    if config.multi_objective_aggregation == "normalize_then_sum":
        values += nanstd(scores, 1).flatten().tolist()
    return [float(v) for v in values if not math.isnan(float(v)) and float(v) > 0]


def test_the_unscorable_and_the_alike_get_no_advantage_and_the_rest_theirs_by_hand():
    """Hand-computed: reward = 2 * sevens_if_asked + shorter_if_said (each None-skipping), advantages over the
    group's scorable completions; a completion no reward scored has advantage 0 and is out of the metrics."""
    config = GrpoConfig(reward=["tests.helpers.rewards:sevens_if_asked", "tests.helpers.rewards:shorter_if_said"],
                        reward_weights=[2.0, 1.0], num_generations=G)
    advantage, metrics, scores = _aspen_scored(config)
    first = [2 * 1 + 1 / 2, 2 * 0 + 1 / 4, 2 * (2 / 3) + 1 / 6, 2 * 0 + 1 / 2]
    mean = sum(first) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in first) / 3)
    assert advantage[0].tolist() == pytest.approx([(r - mean) / (std + 1e-4) for r in first], abs=1e-12)
    assert advantage[1].tolist() == [0.0] * 4                   # all alike
    third = [0.0, 2 * 0 + 1 / 6, 2 * 1 + 1 / 2, 0.0]            # the empty ones: sevens 0, shorter None
    mean3, std3 = sum(third) / 4, math.sqrt(sum((r - sum(third) / 4) ** 2 for r in third) / 3)
    assert advantage[2].tolist() == pytest.approx([(r - mean3) / (std3 + 1e-4) for r in third], abs=1e-12)
    assert advantage[3].tolist() == [0.0] * 4                   # "skip": no reward applies
    assert torch.isnan(scores[3]).all() and not torch.isnan(scores[:3, :, 0]).any()
    scored = first + [2 * 1 + 1 / 4] * 4 + third
    assert metrics["reward"] == pytest.approx(sum(scored) / 12, abs=1e-12)
    assert metrics["rewards/shorter_if_said/mean"] == pytest.approx(
        (1 / 2 + 1 / 4 + 1 / 6 + 1 / 2 + 4 / 4 + 1 / 6 + 1 / 2) / 10, abs=1e-12)
    assert metrics["frac_reward_zero_std"] == pytest.approx(4 / 16)   # the alike group; "skip"'s spread is NaN


@pytest.mark.parametrize(("reward", "message"), [
    ("tests.helpers.rewards:not_finite", "returned a reward that is not finite"),
    ("tests.helpers.rewards:too_few", "returned 1 rewards for 16 completions"),
    ("tests.helpers.rewards:words", "returned a reward that is neither a number nor None (could not convert string "
                                    "to float: 'good')")])
def test_a_reward_among_several_that_fails_is_named(reward, message):
    config = GrpoConfig(reward=["contains", reward], num_generations=G)
    rows = [{"prompt": p, "reference": r} for p, r in zip(PROMPTS, REFERENCES, strict=True) for _ in range(G)]
    with pytest.raises(RewardError) as caught:
        reward_scores(config, [r["prompt"] for r in rows], [t for group in COMPLETIONS for t in group], rows, WORKER)
    assert f"grpo.reward '{reward}'" in str(caught.value) and message in str(caught.value), caught.value


def test_several_rewards_are_checked_in_the_spec():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="reward_weights has 1 weights for 2 rewards"):
        GrpoConfig(reward=["contains", "exact_match"], reward_weights=[1.0])
    with pytest.raises(ValidationError, match="reward names contains more than once"):
        GrpoConfig(reward=["contains", "contains"])
    with pytest.raises(ValidationError, match="reward is an empty list"):
        GrpoConfig(reward=[])
    with pytest.raises(ValidationError, match="reward regex needs pattern"):
        GrpoConfig(reward=["contains", "regex"])
    with pytest.raises(ValidationError, match="neither exact_match, contains, regex nor module:function"):
        GrpoConfig(reward=["contains", "my reward"])
    with pytest.raises(ValidationError, match="reward_weights"):
        GrpoConfig(reward=["contains", "exact_match"], reward_weights=[1.0, float("inf")])
    assert GrpoConfig(reward="contains").weights == (1.0,)
    assert GrpoConfig(reward=["contains", "exact_match"]).weights == (1.0, 1.0)
