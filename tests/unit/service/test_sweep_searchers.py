"""A sweep's trials suggested by a Ray Tune searcher (policies/sweep/searchers.py): Optuna by its Ray Tune name and a
user's `module:Class`. Checked against the searchers' own records: Optuna's study holds exactly the (settings,
objective) pairs the leaderboard shows, each trial's intermediate objectives reached the searcher as Ray Tune
hands them (`on_trial_result` with `training_iteration`); a sweep restored halfway (the searcher's pickled
state in its JSON) asks the same questions and ends as an uninterrupted one; what cannot be built is refused
before anything starts, naming the field."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from actors.service.sweeps.sweep_run import SweepRun
from actors.spec.sweep_spec import SweepSpec
from tests.helpers.sweeps import BEST_LR, JOB, drive, planted_loss, spec

optuna = pytest.importorskip("optuna", reason="the sweep extra (optuna) is part of the dev install")


def test_optunas_study_holds_the_settings_and_objectives_the_leaderboard_shows():
    run = SweepRun(spec(search="optuna", trials=24))
    drive(run)
    board = run.leaderboard()
    assert run.done and len(board["trials"]) == 24
    study = run.searcher.searcher._ot_study            # Optuna's own record, through Ray Tune's OptunaSearch
    told = {tuple(sorted(t.params.items())): t.value for t in study.trials}
    shown = {tuple(sorted(t["settings"].items())): t["objective"] for t in board["trials"]}
    assert told == shown
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    # the rung results reached it as Ray Tune reports them: one intermediate value per evaluation trained
    for trial in study.trials:
        shown_steps = next(t["steps"] for t in board["trials"] if t["settings"] == trial.params)
        assert sorted(trial.intermediate_values) == list(range(JOB["eval_every"], shown_steps + 1, JOB["eval_every"]))
    # TPE's trials once its random start (10) is told (4 run at once) draw on the objectives: nearer the planted
    # lr than the start's (seeds 0-3 all: medians 0.59/0.89/0.97/0.38 against 0.41/0.39/0.35/0.31 decades)
    def distance(trial):
        return abs(math.log10(trial.params["lr"] / BEST_LR))
    assert statistics.median(map(distance, study.trials[14:])) < statistics.median(map(distance, study.trials[:10]))

def test_optuna_maximises_a_generation_metric():
    from tests.helpers.sweeps import planted_score

    run = SweepRun(spec(search="optuna", trials=12, objective={"metric": "contains"}))
    drive(run, measure=planted_score)
    study = run.searcher.searcher._ot_study
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    board = run.leaderboard()
    told = {tuple(sorted(t.params.items())): t.value for t in study.trials}
    assert told == {tuple(sorted(t["settings"].items())): t["objective"] for t in board["trials"]}
    assert study.best_trial.params == next(t["settings"] for t in board["trials"] if t["name"] == board["best"])


def test_a_sweep_with_optuna_restored_halfway_ends_as_an_uninterrupted_one():
    whole = SweepRun(spec(search="optuna", trials=12))
    drive(whole)
    halfway = SweepRun(spec(search="optuna", trials=12))
    drive(halfway, rounds=5)
    assert not halfway.done
    restored = SweepRun.restore(spec(search="optuna", trials=12), json.loads(json.dumps(halfway.state_dict())))
    drive(restored)
    assert restored.leaderboard() == whole.leaderboard()


def test_a_users_searcher_class_is_asked_and_told_as_ray_tune_does():
    space = {"lr": {"choice": [3e-4, 1e-2, 1e-5]},
             "lora.target_modules": {"choice": [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]]}}
    run = SweepRun(spec(search="tests.helpers.searchers:FirstChoices", search_options={"offset": 1}, trials=4,
                        space=space, stopping=None))
    drive(run)
    searcher = run.searcher.searcher
    board = run.leaderboard()
    # the options as given (offset 1 first), the list-valued choice mapped back from its JSON text
    assert [run.trials[f"qa-t{i}"].settings["lr"] for i in range(4)] == [1e-2, 1e-5, 3e-4, 1e-2]
    assert run.trials["qa-t0"].settings["lora.target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert run.jobs["qa-t0"].lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert searcher.completed == {t["name"]: t["objective"] for t in board["trials"]}
    assert [r for r in searcher.results if r[0] == "qa-t0"] == [
        ("qa-t0", step, planted_loss({"lr": 1e-2}, step)) for step in range(10, 91, 10)]


def test_a_diverged_trial_is_told_to_the_searcher_as_an_error():
    run = SweepRun(spec(search="tests.helpers.searchers:FirstChoices", trials=2, stopping=None,
                        space={"lr": {"choice": [1e-3, 1e-4]}}))
    first, second = run.to_start()[:2]
    run.report(first.name, 10, math.nan)
    run.report(second.name, 10, 2.5)
    run.ended(second.name, "completed", 90)
    assert run.searcher.searcher.completed == {first.name: None, second.name: 2.5}


@pytest.mark.parametrize(("search", "options", "message"), [
    ("optuner", {}, "search: 'optuner' is not random, grid, a Ray Tune searcher (optuna, hyperopt"),
    ("no_such_module:Searcher", {}, "search: cannot import no_such_module"),
    ("json:JSONDecoder", {}, "search: json:JSONDecoder is not a Ray Tune searcher (ray.tune.search.Searcher): it "
                             "has no suggest, on_trial_complete"),
    ("optuna", {"n_startup": 3}, "search_options: optuna (ray.tune.search.optuna.optuna_search.OptunaSearch) "
                                 "refused them"),
    ("random", {"seed": 3}, "search_options: the built-in random search takes none"),
])
def test_a_searcher_that_cannot_be_built_is_refused_naming_the_field(search, options, message):
    with pytest.raises(ValueError, match=None) as caught:
        SweepRun(spec(search=search, search_options=options))
    assert message in str(caught.value), str(caught.value)


def test_a_searcher_needs_a_trial_count():
    with pytest.raises(ValueError, match="trials: search optuna needs a number of trials"):
        SweepSpec(**{"name": "lr", "output_dir": "runs/lr", "job": JOB, "search": "optuna",
                     "space": {"lr": {"loguniform": [1e-5, 1e-2]}}})
