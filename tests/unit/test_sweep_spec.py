"""Sweep files (actors/spec/sweep_spec.py) and their search spaces (policies/sweep/search_space.py): every trial a
valid job with its drawn settings, reproducible by seed, random draws distributed as written, grids in
order, and every mistake refused before anything starts, naming the field of the space and the fix."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from actors.spec.job_spec import JobSpec
from actors.spec.sweep_spec import SweepSpec
from policies.sweep.search_space import parse_space, random_trials

JOB = {"name": "qa", "data": "qa.jsonl", "format": {"type": "alpaca"}, "max_steps": 400, "eval_split": 64,
       "eval_every": 20, "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}
SPACE = {"lr": {"loguniform": [1.0e-5, 1.0e-3]}, "lora.r": {"choice": [8, 16, 32]},
         "lora.target_modules": {"choice": [["q_proj", "v_proj"], "all-linear"]}, "warmup_steps": {"randint": [0, 20]}}


def sweep(**overrides) -> SweepSpec:
    return SweepSpec(**{"name": "lr-rank", "output_dir": "runs/lr-rank", "job": JOB, "space": SPACE, "trials": 12,
                        "stopping": {"asha": {"grace_steps": 20}}, **overrides})


def test_each_trial_is_the_job_with_its_settings():
    spec = sweep()
    settings, jobs = spec.trial_settings(), spec.trial_jobs()
    assert [job.name for job in jobs] == [f"qa-t{index}" for index in range(12)]
    for drawn, job in zip(settings, jobs, strict=True):
        assert isinstance(job, JobSpec)
        assert job.lr == drawn["lr"] and job.lora.r == drawn["lora.r"] and job.warmup_steps == drawn["warmup_steps"]
        assert job.lora.target_modules == drawn["lora.target_modules"]
        # the rest is the sweep's job, untouched
        assert (job.max_steps, job.eval_split, job.eval_every, job.lora.alpha) == (400, 64, 20, 16)
        assert 1e-5 <= job.lr <= 1e-3 and job.lora.r in (8, 16, 32) and 0 <= job.warmup_steps <= 20
    assert sweep().trial_settings() == settings                     # the same file and seed: the same trials
    assert sweep(seed=1).trial_settings() != settings


def test_random_draws_follow_their_distributions():
    space = parse_space({"lr": {"loguniform": [1e-5, 1e-3]}, "x": {"uniform": [2.0, 4.0]}, "r": {"choice": [8, 16]}})
    draws = random_trials(space, 4000, seed=0)
    # log-uniform: below the geometric mean half the time; uniform: below the middle half the time; a choice:
    # each option half the time. Each a binomial share of 4000 draws: standard deviation 0.0079, bound 5 of them
    below = {"lr": sum(d["lr"] < math.sqrt(1e-5 * 1e-3) for d in draws), "x": sum(d["x"] < 3.0 for d in draws),
             "r": sum(d["r"] == 8 for d in draws)}
    for name, count in below.items():
        assert abs(count / 4000 - 0.5) < 5 * math.sqrt(0.25 / 4000), (name, count)
    assert all(1e-5 <= d["lr"] <= 1e-3 and 2.0 <= d["x"] <= 4.0 for d in draws)


def test_a_grid_is_every_combination_in_order():
    spec = sweep(space={"lora.r": {"choice": [8, 16]}, "lr": {"choice": [1e-4, 1e-3]}}, search="grid", trials=None)
    assert spec.trial_settings() == [{"lora.r": 8, "lr": 1e-4}, {"lora.r": 8, "lr": 1e-3},
                                     {"lora.r": 16, "lr": 1e-4}, {"lora.r": 16, "lr": 1e-3}]
    assert len(sweep(space={"lora.r": {"choice": [8, 16]}}, search="grid", trials=1).trial_jobs()) == 1


@pytest.mark.parametrize("changes, message", [
    ({"space": {"lora.rank": {"choice": [8]}}}, "space.lora.rank: job.lora has no field 'rank'; did you mean lora.r?"),
    ({"space": {"preference.bta": {"uniform": [0.1, 1]}}}, "did you mean preference.beta?"),
    ({"space": {"lr": {"loguniform": ["1e-06", 1.0e-3]}}}, "space.lr.loguniform: give [low, high] as two numbers, not "
     "['1e-06', 0.001] ('1e-06' is text: YAML reads a number like 1e-5 without a dot as text; write 1.0e-06)"),
    ({"space": {"lr.x": {"uniform": [0.1, 1]}}}, "space.lr.x: job.lr has no field 'x'"),
    ({"space": {"lora.r": {"choice": [2048]}}}, "space.lora.r.choice: 2048 does not make a valid job: lora.r: must be"),
    ({"space": {"lr": {"uniform": [0, 1]}}}, "space.lr.uniform: 0 does not make a valid job: lr: "),
    ({"space": {"name": {"choice": ["a"]}}}, "space.name: a sweep does not vary job.name"),
    ({"space": {"data": {"choice": ["b.jsonl"]}}}, "space.data: a sweep does not vary job.data"),
    ({"space": {"lr": {"loguniform": [0, 1e-3]}}}, "space.lr.loguniform: low 0 must be above 0"),
    ({"space": {"lr": {"loguniform": [1e-3, 1e-5]}}}, "space.lr.loguniform: low 0.001 is not below high 1e-05"),
    ({"space": {"lr": {"normal": [0, 1]}}}, "space.lr: give one of {loguniform: ...}"),
    ({"space": {"warmup_steps": {"randint": [0, 2.5]}}}, "space.warmup_steps.randint: give whole numbers"),
    ({"space": {"lora.r": {"choice": []}}}, "space.lora.r.choice: give a non-empty list"),
    ({"space": {}}, "space: give a mapping of job fields to dimensions"),
    ({"search": "grid"}, "space.lr: a grid search takes only {choice: [...]} dimensions"),
    ({"search": "grid", "space": {"lora.r": {"choice": [8, 16]}}, "trials": 3}, "trials: 3 is more than the grid's 2"),
    ({"trials": None}, "trials: search random needs a number of trials"),
    ({"job": {**JOB, "eval_split": 0}}, "objective: eval_loss needs job.eval_split"),
    ({"stopping": {"asha": {"grace_steps": 500}}}, "stopping.asha.grace_steps: 500 is past job.max_steps 400"),
    ({"job": {**JOB, "max_steps": None, "epochs": 1}}, "stopping.asha: successive halving counts optimizer steps"),
    ({"objective": "exact_match"}, "'exact_match' is a generation metric: write objective: {metric: exact_match}"),
    ({"objective": "accuracy"}, "'accuracy' is not an objective: give eval_loss, train_loss or {metric: ...}"),
    ({"objective": {"metric": "regex"}}, "metric regex needs `pattern`"),
    ({"objective": {"metric": "contains", "max_new_tokens": 0}},
     "objective.max_new_tokens\n  must be between 1 and 4096 (got 0)"),
    ({"objective": {"metric": "contains"}, "job": {**JOB, "eval_every": None}},
     "objective: a generation metric needs job.eval_split (held-out rows) and job.eval_every; set both"),
    ({"objective": {"metric": "contains"}, "stopping": {"predictive": {}}},
     "stopping.predictive forecasts a falling loss curve; with a generation metric as the objective use "
     "stopping.asha"),
    ({"objective": {"metric": "contains"}, "job": {**JOB, "eval_generate": {"metric": "exact_match"}}},
     "job.eval_generate differs from the sweep's objective metric"),
])
def test_mistakes_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValidationError) as error:
        sweep(**changes)
    assert message in str(error.value), str(error.value)


def test_a_generation_metric_is_every_trials_eval_generate_and_is_maximised():
    spec = sweep(objective={"metric": "regex", "pattern": r"(\d+)", "max_new_tokens": 16})
    assert spec.mode == "max" and spec.objective_column == "eval_score"
    for job in spec.trial_jobs():
        assert job.eval_generate == spec.objective
    again = SweepSpec(**spec.model_dump(mode="json"))   # its saved state reads back the same
    assert again == spec
    assert sweep().mode == "min" and sweep().objective_column == "eval_loss"
    assert sweep(objective="train_loss").objective_column == "loss"


def test_the_rows_are_read_once_per_distinct_setting_that_changes_them():
    """`row_jobs`: the sweep's own job where the space changes nothing the row check reads; else one job per
    combination of the row-reading fields' values (both ends of a range, every option; lr and lora.r left out, a
    repeated option once), each with its settings."""
    assert sweep().row_jobs() == [({}, sweep().job)]
    space = {**SPACE, "max_seq_len": {"choice": [64, 512, 64]}, "eval_split": {"randint": [8, 32]},
             "train_on_prompt": {"choice": [False]}}
    found = sweep(space=space).row_jobs()
    assert [settings for settings, _ in found] == [
        {"max_seq_len": m, "eval_split": e, "train_on_prompt": False} for m in (64, 512) for e in (8, 32)]
    assert [(job.max_seq_len, job.eval_split, job.name, job.lora.r) for _, job in found] == [
        (m, e, "qa", 8) for m in (64, 512) for e in (8, 32)]
