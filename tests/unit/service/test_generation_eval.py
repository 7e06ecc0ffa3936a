"""eval_generate: a job's generation metric at each evaluation. The continuations its metric scores are
`transformers`' greedy `generate` of the base with the job's adapter merged (PEFT `merge_and_unload`), on
the same held-out rows; the built-in metrics score texts as stated; a metric that raises fails its job
alone; an older job table gains the score column; bad settings are refused naming the field."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import sqlite3

import pytest
import torch
from pydantic import ValidationError

from actors.data.tokenize import IGNORE_INDEX
from actors.engine.generation_eval import metric_function
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.job_data import JobData
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_loop import TrainerLoop
from actors.spec.evaluation_config import GenerationEval
from actors.spec.job_spec import JobSpec
from tests.helpers import metrics
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import assignment_for, run_until_idle

MAX_NEW = 12


def test_builtin_metrics_score_texts_as_documented():
    exact = metric_function(GenerationEval(metric="exact_match"))
    contains = metric_function(GenerationEval(metric="contains"))
    regex = metric_function(GenerationEval(metric="regex", pattern=r"####\s*(-?[0-9.,]+)"))
    whole = metric_function(GenerationEval(metric="regex", pattern=r"\d+"))
    row = {"prompt": "Q: 2 + 40?\nA:", "reference": " 42 \n"}
    assert exact(" 42", row) == 1.0 and exact("42!", row) == 0.0
    assert contains("it is 42.", row) == 1.0 and contains("4 2", row) == 0.0
    gsm = {"prompt": "", "reference": "2 + 40 = 42\n#### 42"}
    assert regex("so #### 42 done", gsm) == 1.0 and regex("#### 41", gsm) == 0.0 and regex("42", gsm) == 0.0
    assert regex("#### 42", {"prompt": "", "reference": "no answer"}) == 0.0   # the reference has none: no match
    assert whole("x 42 y", {"prompt": "", "reference": "42"}) == 1.0


@pytest.mark.parametrize("settings, field, words", [
    ({"metric": "bleu"}, "eval_generate.metric", "neither exact_match"),
    ({"metric": "regex"}, "eval_generate", "needs `pattern`"),
    ({"metric": "regex", "pattern": "(unclosed"}, "eval_generate", "not a regular expression"),
    ({"metric": "contains", "pattern": "x"}, "eval_generate", "applies to metric regex"),
    ({"metric": "contains", "max_new_tokens": 0}, "eval_generate.max_new_tokens", "between 1 and 4096"),
])
def test_bad_settings_are_refused_naming_the_field(tmp_path, settings, field, words):
    job = job_dict("q", tmp_path / "q.jsonl", 4, eval_split=4, eval_generate=settings)
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(job)
    text = str(caught.value)
    assert field in text and words in text, text


@pytest.mark.parametrize("metric, words", [
    ("tests.helpers.metrics:missing", "tests.helpers.metrics has no function 'missing'"),
    ("no_such_module_here:f", "cannot import module 'no_such_module_here'"),
    ("metrics.py:f", "metrics.py does not exist")])
def test_a_metric_of_the_users_that_does_not_load_is_refused_when_the_jobs_file_is_read(tmp_path, metric, words):
    """Loaded as the jobs file is read (where the user runs aspen), not when a job's spec is validated: the
    scheduler reads its table's specs in a process that need not import the user's code."""
    from orchestrator.jobs_file import SpecError, parse_run_spec

    (tmp_path / "q.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    job = job_dict("q", tmp_path / "q.jsonl", 4, eval_split=4, eval_generate={"metric": metric})
    assert JobSpec.model_validate(job).eval_generate.metric == metric
    with pytest.raises(SpecError) as caught:
        parse_run_spec({"jobs": [job]}, base_dir=tmp_path)
    text = str(caught.value)
    assert "job 'q' (jobs[0]), field eval_generate.metric: '" in text and words in text, text


def test_a_job_without_eval_rows_or_with_preference_pairs_is_refused(tmp_path):
    with pytest.raises(ValidationError, match="eval_split holds none"):
        JobSpec.model_validate(job_dict("q", tmp_path / "q.jsonl", 4, eval_generate={"metric": "contains"}))
    pairs = job_dict("p", tmp_path / "p.jsonl", 4, eval_split=4, method="dpo", format={"type": "preference"},
                     eval_generate={"metric": "contains"})
    with pytest.raises(ValidationError, match="method 'dpo' has none"):
        JobSpec.model_validate(pairs)


def _reference_predictions(model_dir, adapter_dir, examples, tokenizer) -> list[str]:
    """transformers' greedy generate of the base with the adapter merged, row by row, no padding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
    predictions = []
    for example in examples:
        first = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
        prompt = torch.tensor([list(example.input_ids[:first])])
        with torch.no_grad():
            out = merged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                  max_new_tokens=MAX_NEW, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.eos_token_id)
        predictions.append(tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True))
    return predictions


def test_scores_are_the_metric_over_transformers_generate_of_the_merged_adapter(tmp_path, tiny_base,
                                                                                 tiny_model_dirs, monkeypatch):
    data = tmp_path / "data"
    scored = job_dict("scored", write_task_data(data, "scored"), 6, eval_split=5, eval_every=3,
                      eval_generate={"metric": "tests.helpers.metrics:recorded", "max_new_tokens": MAX_NEW})
    other = job_dict("other", write_task_data(data, "other", offset=3), 6, eval_split=4, eval_every=3,
                     eval_generate={"metric": "contains", "max_new_tokens": 4})
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [scored, other], step_tokens=1024)
    submissions = spec.submissions()
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model, step_tokens=1024), "trainer-t",
                       tmp_path / "state")
    for submission in submissions:
        loop.assign(assignment_for(submission, f"{submission.job.name}-1", tiny_base.tokenizer))
    monkeypatch.setenv(metrics.CALLS_FILE, str(tmp_path / "calls.jsonl"))   # read by the metric's own process
    events = run_until_idle(loop)
    loop.trainer.close()
    assert sorted(e.job_id for e in events if e.kind == "completed") == ["other-1", "scored-1"]
    rows = [json.loads(r) for r in (tmp_path / "out/scored/metrics.jsonl").read_text().splitlines()]
    scores = {row["step"]: row["eval_score"] for row in rows if "eval_score" in row}
    assert sorted(scores) == [3, 6]
    evals = [e for e in events if e.kind == "eval" and e.job_id == "scored-1"]
    assert [(e.step, e.data["eval_score"]) for e in evals] == sorted(scores.items())
    _scores_are_shown(tmp_path / "out", rows, scores)
    _the_job_table_keeps_the_last_score(tmp_path / "state", submissions, events, scores)

    data_of = JobData("scored-1", submissions[0], tiny_base.tokenizer)
    data_of.prepare()
    examples = data_of.eval_examples()
    calls = metrics.recorded_calls(tmp_path / "calls.jsonl")
    assert len(calls) == 2 * len(examples)   # every eval row at both evaluations, the other job's not
    final_calls = calls[len(examples):]
    expected = _reference_predictions(tiny_model_dirs["llama"], tmp_path / "out/scored", examples,
                                       tiny_base.tokenizer)
    assert [prediction for prediction, _ in final_calls] == expected
    assert len(set(expected)) > 1   # the rows' continuations differ: the comparison is not of one string
    assert scores[6] == pytest.approx(sum((len(p) % 7) / 6 for p in expected) / len(expected), abs=1e-12)
    # generations.jsonl: each evaluation's rows, what the adapter wrote (transformers' generate of the merged
    # adapter at the end) and each row's score
    written = [json.loads(r) for r in (tmp_path / "out/scored/generations.jsonl").read_text().splitlines()]
    assert [(r["step"], r["row"]) for r in written] == [(step, n) for step in (3, 6) for n in range(len(examples))]
    last = [r for r in written if r["step"] == 6]
    assert [r["prediction"] for r in last] == expected
    assert [r["score"] for r in last] == [(len(p) % 7) / 6 for p in expected]
    assert [r["reference"] for r in last] == [row["reference"] for _, row in final_calls]
    assert [r["prompt"] for r in last] == [row["prompt"] for _, row in final_calls]
    assert not (tmp_path / "out/other/generations.jsonl").read_text().count('"prompt": "Q: scored')
    _generations_are_shown(tmp_path / "state", written)
    for (_, row), example in zip(final_calls, examples, strict=True):
        targets = [t for t, label in zip(example.input_ids, example.labels, strict=True) if label != IGNORE_INDEX]
        assert row["reference"] == tiny_base.tokenizer.decode(targets, skip_special_tokens=True)
        assert row["prompt"].startswith("Q: scored ")


def _scores_are_shown(run_dir, rows, scores) -> None:
    """`aspen report` of the run and `aspen losses` of the job show its scores beside its eval losses."""
    import argparse

    from orchestrator.cli import service_commands
    from orchestrator.report import collect, markdown_table, report_data

    jobs = collect(run_dir)
    reported = {job["job"]: job for job in report_data(jobs)}
    assert reported["scored"]["best_eval_score"] == max(scores.values())
    assert [(e["step"], e["eval_score"]) for e in reported["scored"]["evals"]] == sorted(scores.items())
    lines = markdown_table(jobs).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    row = next([cell.strip() for cell in line.strip("|").split("|")] for line in lines if "| scored |" in line)
    assert header[4] == "best eval score" and row[4] == f"{max(scores.values()):.4f}"

    class Ended:
        @staticmethod
        def losses(job):
            return [{"eval_loss": None, "eval_score": None, **r} for r in rows]

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(service_commands, "_service_or_ended_run", lambda args: Ended())
        service_commands.cmd_losses(argparse.Namespace(job="scored", json=False))
    table = [line.split() for line in printed.getvalue().splitlines()]
    assert table[0][:5] == ["step", "loss", "eval", "loss", "eval"]
    assert {int(line[0]): line[3] for line in table[1:] if line[3] != "-"} == {s: f"{v:.4f}" for s, v in scores.items()}


def _the_job_table_keeps_the_last_score(state_dir, submissions, events, scores) -> None:
    """The trainer's events booked by the scheduler's core: the job's record holds its last score (the last of its
    metrics.jsonl), and `aspen status` / `aspen watch` show it; a job without a metric shows no such column."""
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from orchestrator.progress import summary_table
    from orchestrator.watch import jobs_table
    from policies.fifo import FifoPolicy

    core = SchedulerCore(JobTable(state_dir / "jobs.sqlite"), FifoPolicy(), state_dir)
    # the run's jobs entered after it trained them (their folders hold its outputs), as their events are booked
    core.submit_many(submissions, job_ids=["scored-1", "other-1"], starts_over=True)
    for event in events:
        with core.table.transaction():
            core.apply_event("trainer-t", event)
    record = core.table.get("scored-1")
    assert record.state == "completed" and record.eval_score == scores[max(scores)]
    for table in (summary_table([record]), jobs_table([record])):
        names = [column.header for column in table.columns]
        cells = next(iter(table.columns[names.index("eval score")].cells))
        assert cells == f"{scores[max(scores)]:.4f}"
    record = dataclasses.replace(record, eval_score=None)
    assert "eval score" not in [column.header for column in summary_table([record]).columns]
    core.table.close()


def _generations_are_shown(state_dir, written) -> None:
    """`aspen generations JOB` (and `Client.generations`'s reading) of the ended run: the last evaluation's rows as
    the trainer wrote them, or the one asked for; a step not evaluated is an error naming those that were."""
    from orchestrator.cli.main import main

    by_step = {step: [r for r in written if r["step"] == step] for step in (3, 6)}
    for arguments, step in ((["generations", "scored"], 6), (["generations", "scored", "--step", "3"], 3)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main([*arguments, "--from", str(state_dir), "--json"]) == 0
        assert json.loads(printed.getvalue()) == {"steps": [3, 6], "step": step, "rows": by_step[step],
                                                  "best": None}   # no keep_best: no kept step
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generations", "scored", "--from", str(state_dir)]) == 0
    shown = printed.getvalue()
    mean = sum(r["score"] for r in by_step[6]) / len(by_step[6])
    assert f"the evaluation after step 6 ({len(by_step[6])} rows, mean score {mean:.4g}; evaluated after steps 3, 6)" \
        in " ".join(shown.split())
    assert all(r["prediction"].strip()[:10] in shown for r in by_step[6] if r["prediction"].strip())
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        assert main(["generations", "scored", "--step", "4", "--from", str(state_dir)]) != 0
    assert "no generations after step 4: the job's evaluations with eval_generate were after steps [3, 6]" \
        in errors.getvalue()


def test_a_job_resumed_after_its_trainer_died_writes_each_evaluations_generations_once(tmp_path, tiny_base,
                                                                                         tiny_model_dirs):
    """Evaluated at steps 2 and 4, checkpointed at 3, its trainer gone after step 5: the new trainer resumes it
    from step 3 and evaluates step 4 again; generations.jsonl holds each evaluation's rows once."""
    data = tmp_path / "data"
    job = job_dict("again", write_task_data(data, "again"), 8, eval_split=4, eval_every=2, checkpoint_every=3,
                   eval_generate={"metric": "contains", "max_new_tokens": 3})
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job], step_tokens=1024)
    (submission,) = spec.submissions()
    config = TrainerConfig(base_model=spec.base_model, step_tokens=1024)
    first = TrainerLoop(tiny_base, config, "trainer-t", tmp_path / "state")
    first.assign(assignment_for(submission, "again-1", tiny_base.tokenizer))
    path = tmp_path / "out/again/generations.jsonl"

    def evaluated() -> set[int]:
        return {json.loads(line)["step"] for line in path.read_text().splitlines()} if path.is_file() else set()

    for _ in range(20):   # until its evaluation after step 4 is written
        first.run_once(idle_wait=0)
        if 4 in evaluated():
            break
    assert json.loads((tmp_path / "out/again/checkpoint/state.json").read_text())["step"] == 3
    before = [(r["step"], r["row"]) for r in map(json.loads, path.read_text().splitlines())]
    assert sorted({step for step, _ in before}) == [2, 4]   # step 4's rows are after its checkpoint (3)
    first.trainer.discard("again-1")   # its process gone: the shared test base loses the adapter, nothing else
    second = TrainerLoop(tiny_base, config, "trainer-u", tmp_path / "state")
    second.assign(assignment_for(submission, "again-1", tiny_base.tokenizer))
    events = run_until_idle(second)
    assert next(e for e in events if e.kind == "started").data["resumed_from"] == 3
    assert any(e.kind == "completed" for e in events)
    rows = [(r["step"], r["row"]) for r in map(json.loads, path.read_text().splitlines())]
    assert rows == [(step, n) for step in (2, 4, 6, 8) for n in range(4)], rows


def test_a_metric_that_raises_fails_its_job_alone(tmp_path, tiny_base, tiny_model_dirs):
    data = tmp_path / "data"
    jobs = [job_dict("bad", write_task_data(data, "bad"), 4, eval_split=4, eval_every=2,
                     eval_generate={"metric": "tests.helpers.metrics:broken", "max_new_tokens": 3}),
            job_dict("good", write_task_data(data, "good"), 4, eval_split=4, eval_every=2,
                     eval_generate={"metric": "contains", "max_new_tokens": 3})]
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", jobs, step_tokens=1024)
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=spec.base_model, step_tokens=1024), "trainer-t",
                       tmp_path / "state")
    for submission in spec.submissions():
        loop.assign(assignment_for(submission, f"{submission.job.name}-1", tiny_base.tokenizer))
    events = run_until_idle(loop)
    ends = {e.job_id: e for e in events if e.kind in ("completed", "failed")}
    assert ends["good-1"].kind == "completed"
    assert ends["bad-1"].kind == "failed"
    reason = ends["bad-1"].data["reason"]
    assert "tests.helpers.metrics:broken" in reason and "KeyError" in reason and "after step 2" in reason


def test_an_older_job_table_gains_the_score_column(tmp_path):
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE progress (job_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL, tokens INTEGER, "
               "lr REAL, grad_norm REAL, eval_loss REAL, time REAL NOT NULL, PRIMARY KEY (job_id, step))")
    db.execute("INSERT INTO progress VALUES ('j', 1, 2.5, 10, 0.001, 1.0, 2.7, 0)")
    db.commit()
    db.close()
    db = sqlite3.connect(path)   # a jobs table of before the score column, with a job
    db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, submission TEXT NOT NULL, base_model TEXT "
               "NOT NULL, quantization TEXT NOT NULL, priority INTEGER NOT NULL, output_dir TEXT NOT NULL, state TEXT "
               "NOT NULL, reason TEXT NOT NULL DEFAULT '', trainer TEXT, step INTEGER NOT NULL DEFAULT 0, total_steps "
               "INTEGER, tokens INTEGER NOT NULL DEFAULT 0, loss REAL, eval_loss REAL, tokens_per_s REAL, "
               "checkpoint_step INTEGER, adapter_dir TEXT, submitted_at REAL NOT NULL, started_at REAL, finished_at "
               "REAL, updated_at REAL NOT NULL)")
    db.execute("INSERT INTO jobs (id, name, submission, base_model, quantization, priority, output_dir, state, "
               "submitted_at, updated_at) VALUES ('j', 'j', '{}', 'b', 'none', 0, '/o', 'running', 0, 0)")
    db.commit()
    db.close()
    table = JobTable(path)
    assert table.get("j").eval_score is None
    table.update("j", eval_score=0.5)
    assert table.get("j").eval_score == 0.5
    table.progress.add_eval("j", 1, None, 0.25)
    table.progress.add_eval("j", 2, 2.4, 0.5)
    assert [(r["step"], r["loss"], r["eval_loss"], r["eval_score"]) for r in table.progress.of_job("j")] == [
        (1, 2.5, 2.7, 0.25), (2, None, 2.4, 0.5)]
    table.close()


def test_generations_of_a_job_whose_folder_is_on_another_node_say_so(tmp_path, capsys):
    """`aspen generations` (and Client.generations, the HTTP route) of a job that has started, its folder not on this
    machine (another node's trainer wrote it, no shared output root): an error saying where and what to do, not an
    empty answer as for a job not yet evaluated; a job not started yet has none, said as such."""
    from actors.spec.job_spec import JobSpec
    from actors.spec.job_submission import JobSubmission
    from orchestrator.cli.main import main

    state = tmp_path / "run" / ".aspen"
    table = JobTable(state / "jobs.sqlite")
    spec = JobSpec(name="far", data="unused.jsonl", format={"type": "text"}, max_steps=3)
    with table.transaction():
        table.add("far-1", JobSubmission(job=spec), tmp_path / "on-node-b" / "far")
        table.set_state("far-1", "running", "training on trainer-1")
        table.add("later-1", JobSubmission(job=spec.model_copy(update={"name": "later"})), tmp_path / "later")
    table.close()
    assert main(["generations", "far", "--from", str(state)]) == 2
    error = capsys.readouterr().err
    assert f"job 'far': its folder {tmp_path / 'on-node-b' / 'far'} is not on this machine" in error, error
    assert "an output root every node shares" in error
    assert main(["generations", "later", "--from", str(state)]) == 0
    assert "later: no generations" in capsys.readouterr().out
