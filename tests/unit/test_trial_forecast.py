"""The sweep's predictive stopping rule (policies/sweep/trial_forecast.py) on planted loss curves, whose final values
are known from their formulas: a trial is stopped only when its true final loss is not below the best
finished trial's by min_delta, a trial that would beat it is never stopped (noise-free, and under noise for
many seeds: the rule's optimistic bound), nothing is judged before a trial has finished or before enough
points; through a sweep (actors/service/sweeps/sweep_run.py) it finds the planted best while training fewer steps,
and a sweep restored halfway ends as an uninterrupted one."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from actors.service.sweeps.sweep_run import SweepRun
from policies.sweep.trial_forecast import TrialForecast
from tests.helpers.sweeps import JOB, drive, planted_loss, spec

MAX_STEPS = 100


def curve(floor: float, scale: float = 2.0, power: float = 0.5):
    return lambda step: floor + scale * step ** -power


def test_a_trial_whose_curve_ends_above_the_best_is_stopped_and_one_below_never():
    rule = TrialForecast(max_steps=MAX_STEPS, min_delta=0.01)
    best = curve(1.0)
    for step in range(10, MAX_STEPS + 1, 10):
        assert not rule.report("best", step, best(step)).stop
    assert rule.finals == {"best": best(MAX_STEPS)}
    worse, better = curve(1.2), curve(0.9)          # finals 1.40 and 1.10 against the best's 1.20
    decisions = [rule.report("worse", step, worse(step)) for step in (10, 20, 30, 40, 50)]
    assert [d.stop for d in decisions] == [False, False, False, False, True]   # judged from its 5th point
    assert "cannot beat best's 1.2 by min_delta 0.01" in decisions[-1].reason
    assert not any(rule.report("better", step, better(step)).stop for step in range(10, MAX_STEPS, 10))


def test_a_close_trial_within_min_delta_is_stopped_and_nothing_is_judged_without_a_finished_trial():
    rule = TrialForecast(max_steps=MAX_STEPS, min_delta=0.05)
    early = curve(2.0)
    assert not any(rule.report("early", step, early(step)).stop for step in range(10, 60, 10))   # no rival
    for step in range(10, MAX_STEPS + 1, 10):
        rule.report("best", step, curve(1.0)(step))
    close = curve(0.98)                               # 0.02 better at the end: less than min_delta 0.05
    assert [rule.report("close", s, close(s)).stop for s in (10, 20, 30, 40, 50)] == [False] * 4 + [True]


@pytest.mark.parametrize("seed", range(5))
def test_under_noise_a_trial_that_beats_the_best_clearly_is_not_stopped(seed):
    """Eval losses with 2% noise (the best's own final among them): a trial whose true final is 0.1 (8%) below
    the best's goes on, the clearly worse one is stopped. The rule's optimistic bound is a 10% quantile, so
    some seed could stop the good one; none of the first 200 did (module docstring), 5 run here."""
    rng = np.random.default_rng(seed)
    rule = TrialForecast(max_steps=MAX_STEPS)
    noisy = lambda f, s: f(s) * (1 + 0.02 * rng.standard_normal())   # noqa: E731
    for step in range(10, MAX_STEPS + 1, 10):
        rule.report("best", step, noisy(curve(1.0), step))
    assert not any(rule.report("good", s, noisy(curve(0.9), s)).stop for s in range(10, MAX_STEPS, 10))
    assert any(rule.report("bad", s, noisy(curve(1.6), s)).stop for s in range(10, MAX_STEPS, 10))


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="stopping.predictive.min_points: 3; the curve has 3 parameters"):
        TrialForecast(max_steps=10, min_points=3)
    with pytest.raises(ValueError, match="stopping.predictive: a forecast is made for the trials' last step"):
        spec(job={**JOB, "max_steps": None, "epochs": 1}, stopping={"predictive": {}})


def test_a_sweep_stopping_by_forecast_finds_the_planted_best_and_trains_fewer_steps():
    run = SweepRun(spec(stopping={"predictive": {"min_delta": 0.0}}))
    drive(run)
    board = run.leaderboard()
    final = {t["name"]: planted_loss(t["settings"], JOB["max_steps"]) for t in board["trials"]}
    assert board["best"] == min(final, key=final.get)
    stopped = [t for t in board["trials"] if t["state"] == "stopped"]
    assert stopped and all("cannot beat" in t["stopped_because"] for t in stopped)
    # a stopped trial's true final is not below the best finished before it was stopped (no finished trial
    # better than the final best exists, so: not below the final best)
    assert all(final[t["name"]] >= final[board["best"]] for t in stopped)
    trained = sum(t["steps"] for t in board["trials"])
    assert trained < len(board["trials"]) * JOB["max_steps"] * 0.8, trained


def test_a_sweep_with_both_rules_restored_halfway_ends_as_an_uninterrupted_one():
    stopping = {"asha": {"grace_steps": 10, "reduction": 3}, "predictive": {"min_delta": 0.001}}
    whole = SweepRun(spec(stopping=stopping))
    drive(whole)
    halfway = SweepRun(spec(stopping=stopping))
    drive(halfway, rounds=12)
    assert not halfway.done and halfway.forecast.finals
    restored = SweepRun.restore(spec(stopping=stopping), json.loads(json.dumps(halfway.state_dict())))
    drive(restored)
    assert restored.leaderboard() == whole.leaderboard()
    assert any("cannot beat" in (t["stopped_because"] or "") for t in whole.leaderboard()["trials"])
    assert not math.isnan(whole.leaderboard()["trials"][0]["objective"])
