"""A step's method metrics (a GRPO job's rewards, a preference job's margins: what its metrics.jsonl row has beyond
loss, tokens, lr and grad norm) kept in the job table's progress rows and read back beside the columns, as
`aspen losses` (a reward or margin column), the HTTP API and the console read them; a table an older aspen wrote
gains the column, and one opened read-only without it reads as before."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3

import pytest

from actors.service.table.job_table import JobTable
from actors.service.table.progress_rows import progress_of

ROW = {"step": 1, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "reward": 0.25, "reward_std": 0.1,
       "rewards/sevens/mean": 0.5, "clip_ratio/region_mean": 0.0, "tokens_per_s": 123.0, "total_steps": 9}


def test_a_steps_method_metrics_are_kept_beside_its_columns(tmp_path):
    table = JobTable(tmp_path / "jobs.sqlite")
    table.progress.add("j", ROW)
    table.progress.add("j", {"step": 2, "loss": 0.4, "tokens": 40, "lr": 1e-3, "grad_norm": 0.6})   # an sft row
    table.progress.add_eval("j", 1, 1.5, 0.75)
    first, second = table.progress.of_job("j")
    assert {k: v for k, v in first.items() if k != "time"} == {
        "step": 1, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "eval_loss": 1.5, "eval_score": 0.75,
        "reward": 0.25, "reward_std": 0.1, "rewards/sevens/mean": 0.5, "clip_ratio/region_mean": 0.0}
    assert "reward" not in second and second["loss"] == 0.4   # a row without metrics has none
    table.close()


def test_a_table_without_the_metrics_column_gains_it_and_reads_read_only_as_before(tmp_path):
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE progress (job_id TEXT NOT NULL, step INTEGER NOT NULL, loss REAL, tokens INTEGER, "
               "lr REAL, grad_norm REAL, eval_loss REAL, eval_score REAL, time REAL NOT NULL, "
               "PRIMARY KEY (job_id, step))")
    db.execute("INSERT INTO progress VALUES ('j', 1, 2.5, 10, 0.001, 1.0, 2.7, NULL, 0)")
    db.commit()
    db.close()
    readonly = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)   # as `aspen losses --from` reads a run
    assert [(r["step"], r["loss"], r["eval_loss"]) for r in progress_of(readonly, "j")] == [(1, 2.5, 2.7)]
    readonly.close()
    table = JobTable(path)   # opened for writing: the column is added
    table.progress.add("j", {**ROW, "step": 2})
    assert [r.get("reward") for r in table.progress.of_job("j")] == [None, 0.25]
    table.close()


@pytest.mark.parametrize(("key", "title"), [("reward", "reward"), ("rewards/margins", "margin")])
def test_aspen_losses_shows_a_grpo_jobs_reward_and_a_preference_jobs_margin(monkeypatch, capsys, key, title):
    from orchestrator.cli import service_commands

    rows = [{"step": step, "loss": 0.5, "tokens": 40, "lr": 1e-3, "grad_norm": 0.7, "eval_loss": None,
             "eval_score": None, key: value} for step, value in ((1, 0.25), (2, 0.5))]

    class Ended:
        @staticmethod
        def losses(job):
            return rows

    monkeypatch.setattr(service_commands, "_service_or_ended_run", lambda args: Ended())
    service_commands.cmd_losses(argparse.Namespace(job="j", json=False))
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    assert header[:5] == ["step", "loss", "eval", "loss", title] and "eval score" not in lines[0]
    assert [line.split()[3] for line in lines[1:]] == ["0.2500", "0.5000"]


def test_a_jobs_record_and_its_prometheus_series_carry_its_last_steps_reward_or_margin(tmp_path, tiny_base,
                                                                                      tiny_model_dirs):
    """A grpo job and a dpo job through a trainer loop, their events booked into a scheduler's job table as the
    scheduler books them: each record holds its last optimizer step's reward (grpo) or rewards/margins (dpo), as
    its metrics.jsonl's last row has it, and the metrics endpoint's running-job series show them
    (`aspen_job_reward`, `aspen_job_reward_margin`) until the job leaves `running`."""
    import json

    from actors.service.scheduler.config import MetricsConfig, TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.trainer.trainer_loop import TrainerLoop
    from actors.spec.job_submission import JobSubmission
    from orchestrator.metrics import MetricsListener
    from policies.fifo import FifoPolicy
    from tests.helpers.pairs import ROWS
    from tests.helpers.service import job_dict, write_task_data
    from tests.helpers.trainer import assignment_for, run_until_idle

    state = tmp_path / "state"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in ROWS * 4))
    base_model = str(tiny_model_dirs["llama"])
    jobs = [job_dict("grpo", write_task_data(tmp_path / "data", "arith"), 2, method="grpo", batch_size=2,
                     grpo={"reward": "contains", "num_generations": 3, "max_new_tokens": 4}),
            job_dict("dpo", pairs, 2, method="dpo", batch_size=2, format={"type": "preference"})]
    core = SchedulerCore(JobTable(state / "jobs.sqlite"), FifoPolicy(), state)
    submissions = [JobSubmission(job=job, base_model=base_model, output_dir=str(tmp_path / "out" / job["name"]))
                   for job in jobs]
    records = [core.submit(submission) for submission in submissions]
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=base_model, step_tokens=2048), "trainer-t", state)
    for record, submission in zip(records, submissions, strict=True):
        loop.assign(assignment_for(submission, record.id, tiny_base.tokenizer))
    events = run_until_idle(loop)
    loop.close()
    with core.table.transaction():
        for event in events:
            core.booking.apply_event("trainer-t", event)
    grpo, dpo = (core.table.get(record.id) for record in records)
    last = {name: json.loads((tmp_path / "out" / name / "metrics.jsonl").read_text().splitlines()[-1])
            for name in ("grpo", "dpo")}
    assert grpo.reward == last["grpo"]["reward"] and grpo.reward_margin is None
    assert dpo.reward_margin == last["dpo"]["rewards/margins"] and dpo.reward is None
    assert dpo.reward_margin != 0.0   # the adapters moved the margin off zero: a value was carried

    listener = MetricsListener(MetricsConfig(), serve=False)
    running = [dataclasses.replace(record, state="running") for record in (grpo, dpo)]
    listener.tick(running, {}, [])
    registry = listener.registry
    assert registry.get_sample_value("aspen_job_reward", {"job_id": grpo.id}) == grpo.reward
    assert registry.get_sample_value("aspen_job_reward_margin", {"job_id": dpo.id}) == dpo.reward_margin
    assert registry.get_sample_value("aspen_job_reward", {"job_id": dpo.id}) is None   # a dpo job has no reward
    listener.tick([grpo, dpo], {}, [])   # completed: their series go
    assert registry.get_sample_value("aspen_job_reward", {"job_id": grpo.id}) is None
    assert registry.get_sample_value("aspen_job_reward_margin", {"job_id": dpo.id}) is None


def diverging_after_step_2(monkeypatch) -> None:
    """The engine's optimizer steps as they are, then each job's adapter weights written NaN after its 2nd (as a
    too high lr makes them)."""
    import math

    import torch

    from actors.engine import trainer as engine_trainer

    step_jobs = engine_trainer.step_jobs

    def diverging(optimizers, targets, **options):
        answer = step_jobs(optimizers, targets, **options)
        for optimizer in optimizers:
            if optimizer.step_count == 2:
                with torch.no_grad():
                    for parameter in optimizer.parameters:
                        parameter.fill_(math.nan)
        return answer

    monkeypatch.setattr(engine_trainer, "step_jobs", diverging)


def test_a_batch_job_whose_loss_went_nan_says_it_diverged_in_its_status(tmp_path, tiny_base, tiny_model_dirs,
                                                                        monkeypatch, capsys):
    """An sft job whose adapter's weights went NaN after its 2nd optimizer step (as a too high lr makes them: here
    written NaN, the rest is the real trainer loop's) reports NaN losses from step 3; the job table keeps a NaN as
    NaN (as text: SQLite would store a float NaN as NULL), so `aspen losses` shows `nan` there, not `-` as for a step
    without a loss, and a restarted service reads NaN back. `aspen status` (from the run's
    table, --from) says it diverged, since when and what to do, while it runs and after it completed; before,
    its reason was `trained 5 of 5 steps` alone, as a sound job's."""
    import math

    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.scheduler_core import SchedulerCore
    from actors.service.trainer.trainer_loop import TrainerLoop
    from actors.spec.job_submission import JobSubmission
    from orchestrator.cli.main import main
    from policies.fifo import FifoPolicy
    from tests.helpers.service import job_dict, write_task_data
    from tests.helpers.trainer import assignment_for, run_until_idle

    diverging_after_step_2(monkeypatch)
    state = tmp_path / "state"
    base_model = str(tiny_model_dirs["llama"])
    core = SchedulerCore(JobTable(state / "jobs.sqlite"), FifoPolicy(), state)
    submission = JobSubmission(job=job_dict("sft", write_task_data(tmp_path / "data", "arith"), 5),
                               base_model=base_model, output_dir=str(tmp_path / "out"))
    record = core.submit(submission)
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=base_model, step_tokens=2048), "trainer-t", state)
    loop.assign(assignment_for(submission, record.id, tiny_base.tokenizer))
    events = run_until_idle(loop)
    loop.close()
    losses = {event.step: event.data["loss"] for event in events if event.kind == "progress"}
    assert math.isfinite(losses[2]) and math.isnan(losses[3]), losses   # the engine's own NaN
    with core.table.transaction():
        for event in events:
            if event.kind == "completed":   # the job's reason while it ran on, from its first NaN step
                running = core.table.get(record.id).reason
                assert "its loss is not finite (nan) since step 3: its adapter's weights diverged" in running, running
            core.booking.apply_event("trainer-t", event)
    core.table.close()
    assert main(["status", "sft", "--from", str(state)]) == 0
    shown = capsys.readouterr().out
    assert "state: completed" in shown and "reason: trained 5 of 5 steps; its loss is not finite (nan) since step " \
           "3: its adapter's weights diverged; train it again with a lower lr, or from a checkpoint before that " \
           "step" in " ".join(shown.split()), shown
    assert main(["losses", "sft", "--from", str(state)]) == 0
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[1:]]
    assert [row[1] for row in rows[2:]] == ["nan", "nan", "nan"], rows   # before: "-", as if not measured
    assert [float(row[1]) for row in rows[:2]] == pytest.approx([losses[1], losses[2]], abs=1e-4), rows
    assert all(math.isnan(float(row[1])) for row in rows[2:]), rows
    assert main(["status", "sft", "--from", str(state), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] is None   # strict JSON: a NaN is null (docs/http.md)
    reopened = JobTable(state / "jobs.sqlite")   # as a restarted service reads its table
    try:
        kept = {row["step"]: row["loss"] for row in reopened.progress.of_job(record.id)}
        assert kept[2] == losses[2] and all(math.isnan(kept[step]) for step in (3, 4, 5)), kept
        assert math.isnan(reopened.get(record.id).loss)   # before: None
    finally:
        reopened.close()


def test_trying_a_running_job_whose_weights_went_nan_says_so(tmp_path, tiny_base, tiny_model_dirs, monkeypatch):
    """`aspen try` / POST /v1/jobs/{job}/generate on a running job reach its trainer's `try_prompt`: through
    weights that went NaN, greedy decoding answered an empty continuation as the adapter's; now the call is
    refused (a ValueError: the caller's error) saying the weights diverged and what to do. The reference: the
    same call on the same job before its weights went NaN answers."""
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.trainer.trainer_loop import TrainerLoop
    from actors.spec.job_submission import JobSubmission
    from tests.helpers.service import job_dict, write_task_data
    from tests.helpers.trainer import assignment_for

    diverging_after_step_2(monkeypatch)
    base_model = str(tiny_model_dirs["llama"])
    submission = JobSubmission(job=job_dict("sft", write_task_data(tmp_path / "data", "arith"), 6),
                               base_model=base_model, output_dir=str(tmp_path / "out"))
    loop = TrainerLoop(tiny_base, TrainerConfig(base_model=base_model, step_tokens=2048), "trainer-t",
                       tmp_path / "state")
    loop.assign(assignment_for(submission, "sft-1", tiny_base.tokenizer))
    steps: list[int] = []
    answers = {}
    for _ in range(200):
        loop.run_once(idle_wait=0)
        steps += [event.step for event in loop.drain_events() if event.kind == "progress"]
        if steps and steps[-1] in (1, 3) and steps[-1] not in answers:
            try:
                answers[steps[-1]] = loop.try_prompt("sft-1", "Q: 2+2\nA:", 4)
            except ValueError as error:
                answers[steps[-1]] = error
        if len(answers) == 2:
            break
    loop.close()
    assert isinstance(answers[1], dict) and len(answers[1]["new_tokens"]) > 0, answers
    assert isinstance(answers[3], ValueError), answers[3]
    assert str(answers[3]).startswith("job sft-1's adapter's weights are not finite at step 3 (")
    assert "values are NaN or infinite): its training diverged" in str(answers[3])
    assert "train it again with a lower lr, or from a checkpoint before that step" in str(answers[3])
