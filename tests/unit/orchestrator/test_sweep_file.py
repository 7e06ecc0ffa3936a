"""A sweep file read as users write it (orchestrator/sweep.py): each refusal names the file, the line of the
field it is about (found in the YAML itself, space keys with dots included) and the field; relative paths
are the file's folder's."""

from __future__ import annotations

import pytest

from orchestrator.jobs_file import SpecError
from orchestrator.sweep import load_sweep_spec

SWEEP = """\
name: lr-rank
output_dir: runs/lr-rank
job:
  name: qa
  data: qa.jsonl
  format: {{type: alpaca}}
  max_steps: 40
  eval_split: 8
  eval_every: 4
space:
  lr: {{loguniform: [{low}, 1.0e-3]}}
  lora.r:
    choice: [{rank}, 16]
trials: {trials}
stopping:
  asha: {{grace_steps: {grace}}}
"""


def write(tmp_path, **fields):
    values = {"low": "1.0e-5", "rank": 8, "trials": 4, "grace": 4, **fields}
    (tmp_path / "sweep.yaml").write_text(SWEEP.format(**values))
    return tmp_path / "sweep.yaml"


@pytest.mark.parametrize(("fields", "expected"), [
    ({"rank": 4096}, ":13: space.lora.r.choice: 4096 does not make a valid job: lora.r:"),
    ({"low": "1e-5"}, ":11: space.lr.loguniform: give [low, high] as two numbers"),
    ({"trials": 0}, ":14: trials: must be between 1 and 100000 (got 0)"),
    ({"grace": 400}, ":16: stopping.asha.grace_steps: 400 is past job.max_steps 40"),
])
def test_a_refusal_names_the_line_and_the_field(tmp_path, fields, expected):
    path = write(tmp_path, **fields)
    with pytest.raises(SpecError) as caught:
        load_sweep_spec(path)
    assert f"{path}{expected}" in str(caught.value), str(caught.value)


def test_paths_are_the_files_folders(tmp_path):
    spec = load_sweep_spec(write(tmp_path))
    assert str(spec.job.data) == str(tmp_path / "qa.jsonl") and str(spec.output_dir) == str(tmp_path / "runs/lr-rank")


def test_a_metric_named_by_its_file_is_the_sweep_files_and_one_that_does_not_load_is_refused_at_its_line(tmp_path):
    """objective: {metric: metrics.py:overlap}: the file beside the sweep file, loaded as the trials will load it
    (the same function object, called on a row); a module that cannot be imported, a file without the function,
    one that raises as it runs or is not there, is refused before the sweep starts, at the objective's line."""
    from actors.spec.user_functions import load_user_function

    (tmp_path / "metrics.py").write_text("def overlap(prediction, row):\n"
                                         "    return float(row['reference'] in prediction)\n")
    path = write(tmp_path)
    text = path.read_text()
    path.write_text(text + "objective: {metric: metrics.py:overlap, max_new_tokens: 8}\n")
    spec = load_sweep_spec(path)
    assert spec.objective.metric == f"{tmp_path / 'metrics.py'}:overlap"
    function = load_user_function(spec.objective.metric, "objective.metric")
    assert function("it is 42.", {"prompt": "", "reference": "42"}) == 1.0
    assert function is load_user_function(spec.objective.metric, "objective.metric")   # loaded once a process
    (tmp_path / "broken.py").write_text("RATE = 1 / 0\n")
    for metric, expected in (("metrics:overlap", "cannot import module 'metrics'"),
                             ("metrics.py:nothing", "metrics.py has no function 'nothing'"),
                             ("broken.py:f", "broken.py raised ZeroDivisionError: division by zero"),
                             ("gone.py:f", "gone.py does not exist")):
        path.write_text(text + f"objective: {{metric: '{metric}', max_new_tokens: 8}}\n")
        with pytest.raises(SpecError) as caught:
            load_sweep_spec(path)
        assert f"{path}:17: objective.metric '" in str(caught.value) and expected in str(caught.value), caught.value
        assert "job.eval_generate" not in str(caught.value)   # the objective's metric named once, as the objective


def test_a_grpo_trials_rewards_named_by_their_files_are_the_sweep_files_and_a_bad_one_refused_at_its_line(tmp_path):
    """job.grpo.reward as a list (several rewards, weighted): each `file.py:function` the sweep file's folder's; one
    that does not load refused at its own line, naming its place in the list."""
    (tmp_path / "rewards.py").write_text("def short(prompts, completions, rows):\n"
                                         "    return [1.0 / (1 + len(text)) for text in completions]\n")
    grpo = ("  method: grpo\n  grpo:\n    reward:\n      - rewards.py:short\n      - {second}\n"
            "    reward_weights: [1.0, 0.5]\n    num_generations: 2\n")
    text = write(tmp_path).read_text()
    at = text.index("space:")
    path = tmp_path / "sweep.yaml"
    path.write_text(text[:at] + grpo.format(second="contains") + text[at:])
    spec = load_sweep_spec(path)
    assert spec.job.grpo.rewards == (f"{tmp_path / 'rewards.py'}:short", "contains")
    path.write_text(text[:at] + grpo.format(second="rewards.py:long") + text[at:])
    line = path.read_text().splitlines().index("      - rewards.py:long") + 1
    with pytest.raises(SpecError) as caught:
        load_sweep_spec(path)
    assert f"{path}:{line}: job.grpo.reward.1 '" in str(caught.value), caught.value
    assert "rewards.py has no function 'long'" in str(caught.value)


def test_a_trial_no_step_of_the_sweeps_own_holds_is_refused_naming_the_file_and_the_field(tmp_path, capsys):
    """`aspen sweep FILE` on a service of its own: a job whose micro-batch no step of the file's step_tokens holds
    was refused as a bare validation error of a RunSpec; it names the sweep file and the field, exit 2, and nothing
    starts (no Ray: refused before the service)."""
    from orchestrator.cli import main

    path = write(tmp_path)
    path.write_text(path.read_text() + "step_tokens: 1024\n")
    (tmp_path / "qa.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n' * 20)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: job.max_seq_len: batch_size 4 * max_seq_len 512 = 2048 tokens per micro-batch exceeds " \
           "step_tokens 1024" in err, err
    assert "validation error for RunSpec" not in err


def with_keep_best_eval_score(tmp_path, objective: str | None):
    """The sweep file with job.keep_best: eval_score (and no job.eval_generate), and `objective` where given; the
    path and the line of keep_best."""
    path = write(tmp_path)
    text = path.read_text().replace("  eval_every: 4\n", "  eval_every: 4\n  keep_best: eval_score\n")
    path.write_text(text + (f"objective: {objective}\n" if objective else ""))
    return path, text.splitlines().index("  keep_best: eval_score") + 1


def test_keep_best_eval_score_is_accepted_where_the_objective_gives_every_trial_eval_generate(tmp_path):
    """A generation-metric objective is each trial's eval_generate, which keep_best: eval_score needs: the file is
    accepted (the job's own check, without eval_generate, refused it), each trial keeps its best score's adapter
    by the objective's metric, and the sweep ranks by that kept score; the spec reads back as it was saved."""
    from actors.spec.sweep_spec import SweepSpec

    path, _ = with_keep_best_eval_score(tmp_path, "{metric: exact_match, max_new_tokens: 8}")
    spec = load_sweep_spec(path)
    assert spec.keeps_best and spec.objective_column == "eval_score" and spec.mode == "max"
    trials = spec.trial_jobs()
    assert len(trials) == 4
    assert all(job.keep_best == "eval_score" and job.eval_generate == spec.objective for job in trials)
    assert spec.objective.metric == "exact_match" and spec.objective.max_new_tokens == 8
    assert SweepSpec(**spec.model_dump(mode="json")) == spec   # its saved state (the sweep book's) reads back


@pytest.mark.parametrize(("objective", "fits"), [
    (None, "or use keep_best: eval_loss"),
    ("eval_loss", "or use keep_best: eval_loss"),
    ("train_loss", "or use no keep_best (the train loss has no evaluation)"),
])
def test_keep_best_eval_score_with_nothing_to_score_the_trials_is_refused_at_its_line(tmp_path, objective, fits):
    path, line = with_keep_best_eval_score(tmp_path, objective)
    with pytest.raises(SpecError) as caught:
        load_sweep_spec(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: job.keep_best: eval_score keeps each trial's adapter by its "
                              "eval_generate score, and nothing scores the trials: the job has no eval_generate and "
                              f"the sweep's objective is {objective or 'eval_loss'}; make the objective a generation "
                              "metric (e.g. objective: {metric: exact_match}), which every trial then scores and the "
                              f"sweep ranks by, {fits}"), message
    assert "\n" not in message   # one refusal, not the job's own besides
