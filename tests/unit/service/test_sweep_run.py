"""A sweep's bookkeeping (actors/service/sweeps/sweep_run.py) driven through simulated trials whose loss curves are
planted: one learning rate is best, so the best trial is known from the settings alone. At most
`max_concurrent` trials run, a stopped trial's slot goes to the next at once, the best trial is found and
never stopped, and a sweep saved to JSON and restored halfway ends exactly as one never interrupted."""

from __future__ import annotations

import json
import math

import pytest

from actors.service.sweeps.sweep_run import SweepRun
from tests.helpers.sweeps import JOB, drive, planted_loss, planted_score, spec


def test_a_sweep_finds_the_planted_best_and_stops_the_weak():
    run = SweepRun(spec())
    seen = drive(run)
    assert max(seen) == 4 and seen[0] == 4
    board = run.leaderboard()
    expected = min(run.trials.values(), key=lambda t: planted_loss(t.settings, 90))
    assert board["best"] == expected.name
    states = {t["name"]: t["state"] for t in board["trials"]}
    assert states[expected.name] == "completed"
    stopped = [t for t in board["trials"] if t["state"] == "stopped"]
    assert stopped and all("the best third" in t["stopped_because"] for t in stopped)
    assert all(t["steps"] < JOB["max_steps"] for t in stopped)                 # stopped early, slots freed
    assert set(states.values()) <= {"completed", "stopped"} and run.done
    assert board["trials"][0]["name"] == expected.name                         # best first
    assert set(board["trials"][0]) == {"name", "settings", "state", "objective", "steps", "stopped_because",
                                        "continued_from"}


def test_a_generation_metric_is_maximised_by_halving_and_leaderboard():
    run = SweepRun(spec(objective={"metric": "exact_match"}))
    drive(run, measure=planted_score)
    board = run.leaderboard()
    expected = max(run.trials.values(), key=lambda t: planted_score(t.settings, 90))
    assert board["best"] == expected.name == board["trials"][0]["name"]
    objectives = [t["objective"] for t in board["trials"]]
    assert objectives == sorted(objectives, reverse=True)                      # highest first
    stopped = [t for t in board["trials"] if t["state"] == "stopped"]
    assert stopped and all(" is lower than " in t["stopped_because"] for t in stopped)   # a score: higher is better
    # the same decisions as the loss it mirrors: the score is a falling function of that loss
    mirrored = SweepRun(spec())
    drive(mirrored)
    assert [t["name"] for t in mirrored.leaderboard()["trials"]] == [t["name"] for t in board["trials"]]


def test_a_restored_sweep_ends_as_an_uninterrupted_one():
    whole = SweepRun(spec())
    drive(whole)
    halfway = SweepRun(spec())
    drive(halfway, rounds=4)
    assert not halfway.done
    restored = SweepRun.restore(spec(), json.loads(json.dumps(halfway.state_dict())))
    drive(restored)
    assert restored.leaderboard() == whole.leaderboard()


def test_a_changed_sweep_file_is_not_restored_as_the_old_one():
    run = SweepRun(spec())
    drive(run, rounds=2)
    with pytest.raises(ValueError, match="trial qa-t0 ran with other settings than the file now gives"):
        SweepRun.restore(spec(seed=1), run.state_dict())
    with pytest.raises(ValueError, match=f"it has run {len(run.trials)} trials, more than the file's 2"):
        SweepRun.restore(spec(trials=2), run.state_dict())
    with pytest.raises(ValueError, match="it ran with search random, the file now says grid"):
        SweepRun.restore(spec(search="grid", trials=None, space={"lora.r": {"choice": [8, 16]}}), run.state_dict())
    more = SweepRun.restore(spec(trials=20), run.state_dict())   # more trials of the same draw: carries on
    assert drive(more) and len(more.trials) == 20


def test_without_halving_a_diverged_trial_still_stops():
    run = SweepRun(spec(stopping=None))
    first = run.to_start()[0]
    decision = run.report(first.name, 10, math.nan)
    assert decision.stop and "NaN" in decision.reason
    assert run.trials[first.name].state == "stopped" and "NaN" in run.trials[first.name].stopped_because
    assert len(run.to_start()) == 1      # its slot goes to the next trial
    run.ended(first.name, "cancelled")   # the driver's cancel arriving later changes nothing
    assert run.trials[first.name].state == "stopped"


def test_results_read_after_a_trial_ended_still_count_at_the_rungs():
    run = SweepRun(spec(max_concurrent=2))
    first, second = run.to_start()
    assert not run.report(first.name, 10, 4.0).stop
    # the second trial's job ended before its results were read: judged weak at the rung, but there is
    # nothing left to stop; it ends as its job did, and its result counts for the trials after it
    late = run.report(second.name, 10, 5.0, live=False)
    assert late.stop and run.trials[second.name].state == "running"
    run.ended(second.name, "completed", 90)
    assert run.trials[second.name].state == "completed" and run.trials[second.name].stopped_because is None
    third = run.to_start()[0]
    assert run.report(third.name, 10, 4.8).stop                    # outside the best third of {4.0, 5.0}
    assert run.halving.recorded[0] == {first.name: -4.0, second.name: -5.0, third.name: -4.8}


def test_with_keep_best_a_trial_ranks_by_the_adapter_it_keeps():
    """Trial t0 overfits (its eval loss falls to 1.0 at step 30, then rises to 2.0), t1 only falls (to 1.5): the
    adapter t0 ends with under job.keep_best is its step-30 one (1.0), so it is the best trial, and the searcher
    hears 1.0; without keep_best it ends with its last (2.0) and t1 is best. A keep_best that does not match the
    sweep's objective is refused (the leaderboard would rank adapters the trials do not keep)."""
    def curve(settings: dict, step: int) -> float:
        if settings["lr"] == 1e-3:
            return 1.0 + abs(step - 30) / 60
        return 1.5 + 1.0 / step

    grid = {"search": "grid", "trials": 2, "space": {"lr": {"choice": [1e-3, 1e-4]}}, "stopping": None}
    plain = SweepRun(spec(**grid))
    drive(plain, measure=curve)
    assert plain.leaderboard()["best"] == "qa-t1"
    kept = SweepRun(spec(**grid, job=JOB | {"keep_best": "eval_loss"}))
    drive(kept, measure=curve)
    board = kept.leaderboard()
    assert board["best"] == "qa-t0" and board["trials"][0]["objective"] == 1.0, board
    with pytest.raises(ValueError, match=r"job.keep_best: eval_loss would keep each trial's adapter by its eval loss, "
                                         r"and the sweep ranks trials by train_loss"):
        spec(**grid, job=JOB | {"keep_best": "eval_loss"}, objective="train_loss")


def test_with_keep_best_eval_score_a_generation_metric_sweep_ranks_each_trial_by_its_highest_score():
    """A sweep ranking by a generation metric, its job keeping the best score's adapter (keep_best: eval_score,
    with no eval_generate of its own: the objective gives every trial one): t0's score peaks at 0.9 at step 30 and
    falls to 0.6, t1's rises to 0.75; t0 keeps its 0.9 adapter and is the best trial, as its curve's peak says.
    Without keep_best the last scores rank (t1 first)."""
    def curve(settings: dict, step: int) -> float:
        if settings["lr"] == 1e-3:
            return 0.9 - abs(step - 30) / 200
        return 0.75 - 1.0 / step

    grid = {"search": "grid", "trials": 2, "space": {"lr": {"choice": [1e-3, 1e-4]}}, "stopping": None,
            "objective": {"metric": "exact_match"}}
    plain = SweepRun(spec(**grid))
    drive(plain, measure=curve)
    assert plain.leaderboard()["best"] == "qa-t1"
    kept = SweepRun(spec(**grid, job=JOB | {"keep_best": "eval_score"}))
    assert all(job.keep_best == "eval_score" and job.eval_generate is not None for job in kept.spec.trial_jobs())
    drive(kept, measure=curve)
    board = kept.leaderboard()
    peak = max(curve({"lr": 1e-3}, step) for step in range(10, JOB["max_steps"] + 1, JOB["eval_every"]))
    assert board["best"] == "qa-t0" and board["trials"][0]["objective"] == peak == 0.9, board
