"""The predictive stop rule on loss curves with a known shape: a plateaued job stops, an improving one
does not, noise does not fool it, and the prediction of the final loss is close to the truth."""

from __future__ import annotations

import random

from policies.stopping import LossHistory, PredictiveRule, fit_power_law


def curve(a: float, b: float, c: float, steps: list[int], noise: float = 0.0, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(s, a + b * s ** (-c) + rng.gauss(0, noise)) for s in steps]


def test_a_power_law_is_recovered_and_extrapolated():
    points = curve(1.2, 3.0, 0.5, list(range(10, 210, 10)), noise=0.002)
    fit = fit_power_law(points)
    truth = 1.2 + 3.0 * 2000 ** -0.5
    assert abs(fit(2000) - truth) / truth < 0.02


def test_a_plateaued_job_stops_and_an_improving_one_does_not():
    rule = PredictiveRule(min_improvement=0.01, patience=3, budget_steps=1000)
    steps = list(range(20, 320, 20))
    # most of the gain is behind: from step 300 to 1000 the true improvement is ~0.4%
    plateau = LossHistory(eval=curve(1.0, 8.0, 1.5, steps, noise=0.001, seed=1))
    decision = rule.decide(plateau)
    assert decision is not None and "< min_improvement" in decision.reason
    # still improving: a slow power law, ~20% better by step 1000
    improving = LossHistory(eval=curve(0.5, 3.0, 0.35, steps, noise=0.001, seed=2))
    assert rule.decide(improving) is None


def test_noise_and_too_few_points_do_not_stop_a_job():
    rule = PredictiveRule(min_improvement=0.01, patience=3, budget_steps=1000)
    assert rule.decide(LossHistory(eval=curve(1.0, 8.0, 1.5, [20, 40, 60, 80, 100]))) is None   # < patience + 3
    noisy = LossHistory(eval=curve(0.5, 3.0, 0.35, list(range(20, 320, 20)), noise=0.05, seed=3))
    assert rule.decide(noisy) is None       # the optimistic bound still sees a real gain


def test_without_eval_losses_the_smoothed_train_loss_is_used():
    rule = PredictiveRule(min_improvement=0.01, patience=3, budget_steps=2000, every=10)
    train = curve(1.0, 8.0, 1.5, list(range(1, 401)), noise=0.01, seed=4)
    decision = rule.decide(LossHistory(train=train))
    assert decision is not None and decision.reason.startswith("smoothed train loss")


def test_the_predicted_stop_step_lies_ahead_for_an_improving_job():
    rule = PredictiveRule(min_improvement=0.01, patience=3, budget_steps=1000)
    steps = list(range(20, 320, 20))
    improving = LossHistory(eval=curve(0.5, 3.0, 0.35, steps, noise=0.001, seed=2))
    stop = rule.predicted_stop_step(improving)
    assert stop is not None and 300 < stop <= 1000
    plateau = LossHistory(eval=curve(1.0, 8.0, 1.5, steps, noise=0.001, seed=1))
    assert rule.predicted_stop_step(plateau) <= 300          # already past its useful budget
    assert rule.predicted_stop_step(LossHistory(eval=steps_only(steps[:4]))) is None


def steps_only(steps: list[int]) -> list[tuple[int, float]]:
    return [(s, 1.0 / s) for s in steps]


def test_an_overfitting_job_stops():
    rule = PredictiveRule(min_improvement=0.01, patience=3, budget_steps=1000)
    steps = list(range(20, 180, 20))
    rising = LossHistory(eval=[(s, 2.0 + 3 * s ** -0.8 + 0.002 * s) for s in steps])   # down, then up
    decision = rule.decide(rising)
    assert decision is not None and "has not improved on its best" in decision.reason
    assert fit_power_law([(s, 2.0 + 0.002 * s) for s in steps]).b == 0.0    # a rising curve fits as flat


def test_no_stop_within_the_budgets_last_patience_evaluations():
    steps = list(range(20, 320, 20))
    plateau = LossHistory(eval=curve(1.0, 8.0, 1.5, steps, noise=0.001, seed=1))
    assert PredictiveRule(0.01, 3, budget_steps=360, every=20).decide(plateau) is None     # 3 evaluations left
    assert PredictiveRule(0.01, 3, budget_steps=380, every=20).decide(plateau) is not None
