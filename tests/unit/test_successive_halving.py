"""Successive halving (policies/sweep/successive_halving.py) against a trace computed by hand and against Ray Tune's
own ASHAScheduler fed the same results in the same order."""

from __future__ import annotations

import math
import random

import pytest

from policies.sweep.successive_halving import SuccessiveHalving


def test_a_hand_computed_trace():
    halving = SuccessiveHalving(grace_steps=1, max_steps=9, reduction=3)   # rungs at steps 1, 3 and 9
    assert halving.rungs == [1, 3, 9]
    first = halving.report("a", 1, 1.0)
    assert not first.stop and first.cutoff is None and first.rung == 1          # the first at a rung goes on
    # b against {a: 1.0}: the best third's bound is 1.0 itself
    b = halving.report("b", 1, 2.0)
    assert b.stop and b.cutoff == pytest.approx(1.0)
    assert b.reason == ("objective 2 at step 1 is higher than 1, the objective of the one trial judged at step 1 "
                        "before it (asha keeps the best third)")
    # c against {1.0, 2.0}: the 1/3 quantile, 1.0 + (2.0 - 1.0) / 3 = 1.333 (losses: lower is better)
    c = halving.report("c", 1, 0.5)
    assert not c.stop and c.cutoff == pytest.approx(4 / 3)
    # d against {0.5, 1.0, 2.0}: position (3 - 1) / 3 = 0.667 between 0.5 and 1.0: 0.833
    d = halving.report("d", 1, 3.0)
    assert d.stop and d.cutoff == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert d.reason == ("objective 3 at step 1 is higher than 0.8333, the cut-off for the best third of the 3 "
                        "trials judged at step 1 before it")
    assert halving.report("a", 2, 0.95).rung is None                           # between rungs: nothing new
    assert not halving.report("a", 3, 0.9).stop
    assert not halving.report("c", 3, 0.4).stop                               # 0.4 <= a's 0.9
    # a trial first heard of past two rungs is judged at the higher one only (as Ray Tune does)
    late = halving.report("e", 4, 0.95)
    assert late.rung == 3 and late.stop and late.cutoff == pytest.approx(0.4 + (0.9 - 0.4) / 3)   # {0.4, 0.9}
    assert "e" not in halving.recorded[0]
    assert halving.report("f", 2, math.nan).stop                              # diverged: stopped at once
    end = halving.report("g", 9, 100.0)                   # at max_steps the trial has trained: it completes
    assert not end.stop and end.rung is None and "g" not in halving.recorded[2]


def test_scores_to_maximise():
    halving = SuccessiveHalving(grace_steps=2, max_steps=8, reduction=2, mode="max")
    assert not halving.report("a", 2, 0.4).stop
    b = halving.report("b", 2, 0.3)                  # below the best half's bound 0.4
    assert b.stop and b.reason.startswith("objective 0.3 at step 2 is lower than 0.4, the objective of the one")
    assert not halving.report("c", 2, 0.5).stop


@pytest.mark.parametrize("bad, field", [({"grace_steps": 0}, "grace_steps"), ({"grace_steps": 50}, "grace_steps"),
                                        ({"reduction": 1.0}, "reduction"), ({"mode": "up"}, "mode")])
def test_bad_settings_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SuccessiveHalving(**{"grace_steps": 2, "max_steps": 40, **bad})


@pytest.mark.parametrize("seed, reduction, mode", [(0, 3, "min"), (1, 2, "min"), (2, 4, "max"), (3, 3, "max")])
def test_decisions_equal_ray_tunes_asha_scheduler(seed, reduction, mode):
    from ray.tune.experiment import Trial
    from ray.tune.schedulers import ASHAScheduler

    grace, max_steps = 2, 40
    ours = SuccessiveHalving(grace_steps=grace, max_steps=max_steps, reduction=reduction, mode=mode)
    theirs = ASHAScheduler(time_attr="step", metric="objective", mode=mode, max_t=max_steps, grace_period=grace,
                           reduction_factor=reduction)
    rng = random.Random(seed)
    trials = {f"t{index}": Trial("__fake", stub=True) for index in range(16)}
    for trial in trials.values():
        theirs.on_trial_add(None, trial)
    # each trial: a noisy decaying curve of its own level, reported every 1-3 steps, trials interleaved at random
    level = {name: rng.uniform(0.5, 2.0) for name in trials}
    step = dict.fromkeys(trials, 0)
    running = set(trials)
    decisions = 0
    while running:
        name = rng.choice(sorted(running))
        step[name] += rng.randint(1, 3)
        if step[name] >= max_steps:    # Ray Tune stops a trial at max_t; here it completes
            running.discard(name)
            continue
        value = level[name] / math.sqrt(step[name]) + rng.gauss(0, 0.05)
        value = -value if mode == "max" else value
        ray_stop = theirs.on_trial_result(None, trials[name], {"step": step[name], "objective": value}) == "STOP"
        decision = ours.report(name, step[name], value)
        assert decision.stop == ray_stop, (name, step[name], value, decision)
        decisions += 1
        if decision.stop:
            running.discard(name)
    assert decisions > 50 and 0 < theirs._num_stopped < len(trials)
