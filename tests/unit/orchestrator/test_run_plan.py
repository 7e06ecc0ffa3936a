"""`aspen run` again on the same output folder (orchestrator/run_plan.py): which earlier jobs are left alone, resumed,
started again or refused, as the README and docs/methods.md, the refusal and `--help` say it: `--overwrite` starts
over only the jobs whose spec or data changed; a job that finished unchanged is never deleted; a job that failed
before its first checkpoint starts again on its changed spec without `--overwrite`."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

from actors.service.table.job_table import JobRecord
from actors.spec.run_spec import RunSpec
from orchestrator.run_plan import OVERWRITE_HELP, changed_message, foreign_message, plan_run

README = Path(__file__).resolve().parents[3] / "README.md"


def _spec(tmp_path: Path, lrs: dict[str, float]) -> RunSpec:
    return RunSpec(output_dir=tmp_path, jobs=[
        {"name": name, "data": "data.jsonl", "format": {"type": "text"}, "lr": lr, "max_steps": 10}
        for name, lr in lrs.items()])


def _record(submission, state: str, checkpoint_step: int | None = None, step: int = 10) -> JobRecord:
    now = time.time()
    return JobRecord(id=f"id-{submission.job.name}", name=submission.job.name, state=state, reason="", base_model="m",
                     quantization="none", priority=0, output_dir=str(submission.output_dir), trainer=None, step=step,
                     total_steps=10, tokens=0, loss=None, eval_loss=None, tokens_per_s=None,
                     checkpoint_step=checkpoint_step, adapter_dir=None, submitted_at=now, started_at=now,
                     finished_at=now, updated_at=now)


def test_a_finished_unchanged_job_is_left_alone_and_only_the_changed_one_would_start_over(tmp_path):
    """The user's sequence: 'done' finished, 'edited' finished too and then had its spec changed: the plan keeps
    'done' (never deleted, with or without --overwrite) and refuses 'edited' without --overwrite, naming it."""
    before = _spec(tmp_path, {"done": 1e-3, "edited": 1e-3}).submissions()
    after = _spec(tmp_path, {"done": 1e-3, "edited": 5e-4}).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(before[0], "completed", 10), _record(before[1], "completed", 10)]
    plan = plan_run(after, records, stored.__getitem__)
    assert [r.name for r in plan.done] == ["done"]
    assert [name for name, _ in plan.changed] == ["edited"] and [r.name for r in plan.changed_records] == ["edited"]
    assert not plan.submit and not plan.resume and not plan.retry
    message = changed_message(tmp_path, plan.changed)
    assert "'edited'" in message and "lr: 0.001 -> 0.0005" in message
    assert "the file's other jobs resume or are left alone" in message
    assert "the file's other jobs resume or are left alone" in OVERWRITE_HELP


def test_a_job_that_failed_before_any_checkpoint_starts_again_on_its_changed_spec(tmp_path):
    before = _spec(tmp_path, {"done": 1e-3, "broken": 1e-3, "interrupted": 1e-3}).submissions()
    after = _spec(tmp_path, {"done": 1e-3, "broken": 2e-3, "interrupted": 2e-3}).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(before[0], "completed", 10), _record(before[1], "failed", None, step=0),
               _record(before[2], "failed", None, step=3)]
    # 'interrupted' left a checkpoint on disk that its table never heard of (a run killed at once)
    on_disk = {str(before[2].output_dir): 3}
    plan = plan_run(after, records, stored.__getitem__, saved_step=on_disk.get)
    assert [r.name for r in plan.done] == ["done"]
    assert [record.name for record, _ in plan.retry] == ["broken"]
    assert [s.job.name for s in plan.submit] == ["broken"] and plan.submit[0].job.lr == 2e-3
    assert [name for name, _ in plan.changed] == ["interrupted"]   # its checkpoint would be mixed: --overwrite
    assert any("broken: failed in the last run with no checkpoint; starts again" in line for line in plan.lines())


def test_the_readme_says_what_overwrite_does():
    text = README.read_text()
    assert "`--overwrite` starts those jobs over, only those" in text
    methods = (README.parent / "docs" / "methods.md").read_text()
    assert "`--overwrite` starts\nthose jobs over, and only those" in methods
    assert "aspen run --overwrite jobs.yaml  # start over the jobs whose spec or data changed (only those)" in text


def test_a_raised_budget_continues_a_job_but_not_one_its_stop_rule_would_end_again(tmp_path):
    """max_steps raised alone: a completed job continues from its checkpoint; one its early_stop rule ended is left
    alone, saying that it would stop again at once and how to train it on (it was said to continue, then ended at the
    same step having trained nothing); without early_stop it continues."""
    def spec(steps: int, early_stop: bool) -> RunSpec:
        jobs = [{"name": name, "data": "data.jsonl", "format": {"type": "text"}, "max_steps": steps,
                 **({"early_stop": {"patience": 3}, "eval_split": 2, "eval_every": 2} if early_stop else
                    {"eval_split": 2, "eval_every": 2})} for name in ("ran-out", "stopped")]
        return RunSpec(output_dir=tmp_path, jobs=jobs)

    before = spec(10, True).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(before[0], "completed", 10), _record(before[1], "stopped_early", 6, step=6)]
    plan = plan_run(spec(20, True).submissions(), records, stored.__getitem__)
    assert [r.name for r, _ in plan.extend] == ["ran-out"] and [r.name for r in plan.done] == ["stopped"]
    assert ("stopped: its stop rule ended it at step 6, and would again at once: a raised max_steps continues it "
            "without early_stop (remove it from the job)") in plan.lines()
    plan = plan_run(spec(20, False).submissions(), records, stored.__getitem__)
    assert sorted(r.name for r, _ in plan.extend) == ["ran-out", "stopped"] and not plan.changed


def test_a_raised_budget_leaves_alone_a_job_its_epochs_ended_before_its_max_steps(tmp_path):
    """`aspen run` again with max_steps raised on a job that also has `epochs`: where its epochs ended it before its
    max_steps (the step `planned_steps` gives, the reference) it is left alone, saying so and what to do (it was said
    to continue from its checkpoint, the base loaded, and it ended at the same step having trained nothing); where
    its max_steps ended it first, it continues to the raised budget."""
    from actors.spec.job_spec import planned_steps

    def spec(steps: dict[str, int]) -> RunSpec:
        return RunSpec(output_dir=tmp_path, jobs=[
            {"name": name, "data": "data.jsonl", "format": {"type": "text"}, "max_steps": max_steps, "epochs": 1,
             "batch_size": 2} for name, max_steps in steps.items()])

    rows = 10   # one epoch: 5 steps
    before = spec({"by-epochs": 100, "by-steps": 3}).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = []
    for submission in before:
        total = planned_steps(submission.job, rows)
        record = _record(submission, "completed", total, step=total)
        records.append(dataclasses.replace(record, total_steps=total))
    plan = plan_run(spec({"by-epochs": 200, "by-steps": 4}).submissions(), records, stored.__getitem__)
    assert [r.name for r, _ in plan.extend] == ["by-steps"] and [r.name for r in plan.done] == ["by-epochs"]
    assert ("by-epochs: max_steps raised to 200, but it is bound by epochs: its 1 epoch(s) of data ended it at "
            "step 5, before its max_steps 100, so a larger max_steps alone would train nothing more; raise its epochs "
            "to continue it into more of its data (aspen extend JOB --epochs N, or epochs in its jobs file), or start "
            "a new job (init_adapter: job:NAME continues from its adapter)") in plan.lines()


def test_a_raised_epochs_continues_a_job_its_epochs_ended_and_is_refused_where_it_cannot(tmp_path):
    """`aspen run` again with `epochs` changed: raised on a job its epochs ended (alone, or with max_steps raised
    beside it) it continues from its checkpoint, said so; raised alone on a job its max_steps ended it is left alone
    (it would train nothing), saying to raise max_steps too; lowered, or added to a job that had none, it is a changed
    spec (--overwrite) saying why it cannot continue. The steps the epochs end at are `planned_steps`'."""
    from actors.spec.job_spec import planned_steps

    def spec(jobs: dict[str, dict]) -> RunSpec:
        return RunSpec(output_dir=tmp_path, jobs=[{"name": name, "data": "data.jsonl", "format": {"type": "text"},
                                                   "batch_size": 2, **budget} for name, budget in jobs.items()])

    rows = 10   # one epoch: 5 steps
    before = spec({"alone": {"epochs": 1}, "capped": {"epochs": 1, "max_steps": 100},
                   "by-steps": {"epochs": 1, "max_steps": 3}, "both": {"epochs": 1, "max_steps": 3},
                   "lowered": {"epochs": 2}, "added": {"max_steps": 4}}).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = []
    for submission in before:
        total = planned_steps(submission.job, rows)
        records.append(dataclasses.replace(_record(submission, "completed", total, step=total), total_steps=total))
    after = spec({"alone": {"epochs": 2}, "capped": {"epochs": 3, "max_steps": 100},
                  "by-steps": {"epochs": 2, "max_steps": 3}, "both": {"epochs": 2, "max_steps": 8},
                  "lowered": {"epochs": 1}, "added": {"max_steps": 4, "epochs": 1}}).submissions()
    plan = plan_run(after, records, stored.__getitem__)
    assert [r.name for r, _ in plan.extend] == ["alone", "capped", "both"]
    lines = plan.lines()
    assert "alone: completed at step 5; epochs raised to 2: it continues from its checkpoint at step 5" in lines
    assert ("both: completed at step 3; max_steps raised to 8 and epochs raised to 2: it continues from its "
            "checkpoint at step 3") in lines
    assert [r.name for r in plan.done] == ["by-steps"]
    assert ("by-steps: epochs raised to 2, but it is bound by max_steps: its max_steps 3 ended it before its 1 "
            "epoch(s) of data did, so a larger epochs alone would train nothing more; raise max_steps too (aspen "
            "extend JOB --max-steps N --epochs N, or both in its jobs file)") in lines
    changed = dict(plan.changed)
    assert changed["lowered"] == ["epochs lowered 2 -> 1: a job continues from its checkpoint only to a larger "
                                  "budget; give epochs above 2, or start a new job to train it less"]
    [added] = changed["added"]
    assert added.startswith("epochs added (1) to a job that had none: its data was repeated until its max_steps")
    assert "a different data order" in added
    message = changed_message(tmp_path, plan.changed)
    assert "'lowered', 'added'" in message and "--overwrite" in message


def test_a_raised_budget_on_a_job_whose_checkpoint_is_gone_is_refused_as_such(tmp_path):
    """max_steps raised alone on a finished job whose checkpoint is no longer on disk (`saved_step` finds none,
    as `actors.checkpoint.saved_step` reads the folder): it cannot continue, so the run stops naming it and why, and
    `--overwrite` starts it over (it was said to continue from its checkpoint and trained again from step 0); one
    whose checkpoint is there continues."""
    def spec(steps: int) -> RunSpec:
        return RunSpec(output_dir=tmp_path, jobs=[{"name": name, "data": "data.jsonl", "format": {"type": "text"},
                                                   "max_steps": steps} for name in ("kept", "gone")])

    before = spec(10).submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(submission, "completed", 10) for submission in before]
    on_disk = {str(before[0].output_dir): 10}
    plan = plan_run(spec(20).submissions(), records, stored.__getitem__, saved_step=on_disk.get)
    assert [r.name for r, _ in plan.extend] == ["kept"] and [r.name for r in plan.started_over] == ["gone"]
    assert plan.changed == [] and [(record.name, why) for record, why in plan.lost] == [
        ("gone", f"max_steps raised 10 -> 20, but its checkpoint at step 10 is no longer in its folder "
                 f"{before[1].output_dir} (deleted, moved or damaged), so it cannot continue from it")]


def test_only_a_new_jobs_folder_is_asked_for_earlier_outputs_and_the_refusal_names_them(tmp_path):
    """A new job (no record of its name and folder) whose folder holds outputs is `foreign`; a job the table knows is
    planned as before, its folder never asked. The refusal names the job, what was found, where the table records a
    job of that name, and the two ways on (another output_dir, --overwrite)."""
    from actors.service.outputs.earlier_outputs import EarlierOutputs

    before = _spec(tmp_path / "out", {"known": 1e-3, "copied": 1e-3}).submissions()
    after = _spec(tmp_path / "out2", {"copied": 1e-3}).submissions() + [before[0]]
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(before[0], "completed", 10), _record(before[1], "completed", 10)]
    asked = []

    def found(folder: str) -> EarlierOutputs:
        asked.append(folder)
        return EarlierOutputs(folder=Path(folder), job="copied", step=10, checkpoint_step=10,
                              found=["its adapter (aspen.json)", "a checkpoint at step 10"], written_at=0.0)

    plan = plan_run(after, records, stored.__getitem__, found_outputs=found)
    assert asked == [str(after[0].output_dir)] and [r.name for r in plan.done] == ["known"]
    assert [s.job.name for s in plan.submit] == ["copied"] and [name for name, _ in plan.foreign] == ["copied"]
    message = foreign_message(tmp_path / "out2", plan.foreign, records)
    assert (f"job 'copied': {tmp_path / 'out2/copied'} holds job 'copied' at step 10: its adapter (aspen.json), a "
            "checkpoint at step 10; last written ") in message
    assert (f"its table records job 'copied' in {tmp_path / 'out/copied'}: a run with output_dir {tmp_path / 'out'} "
            "resumes it or leaves it alone there") in message
    assert message.endswith("give this run another output_dir (--output-dir), or run with --overwrite to delete those "
                            "outputs and start 'copied' over there")
    assert "the new jobs whose folders hold outputs the job table has no record of" in OVERWRITE_HELP


def test_aspen_run_again_on_a_job_whose_checkpoint_is_gone_says_so_and_overwrite_starts_it_over(tmp_path,
                                                                                               tiny_model_dirs):
    """The user's sequence: `aspen run` trains two jobs, the first's checkpoint folder is deleted, its max_steps
    raised, and `aspen run` again: it stops (exit 2, before Ray) saying that the checkpoint it would continue from
    is gone, which job, and the two ways on; not that the spec changed. `--overwrite` then trains that job from
    step 0 to its new budget, the other left alone."""
    from tests.helpers.interrupted_runs import NO_RAY, metric_steps, run, write_run

    jobs = write_run(tmp_path, tiny_model_dirs["llama"], steps=3, every=1000)
    code, out, err = run(tmp_path, "--in-process", env=NO_RAY)
    assert code == 0, (out, err)
    second = (tmp_path / "out/second/adapter_model.safetensors").read_bytes()
    shutil.rmtree(tmp_path / "out/first/checkpoint")
    jobs.write_text(jobs.read_text().replace("max_steps: 3", "max_steps: 5", 1))
    code, out, err = run(tmp_path, env=NO_RAY)
    assert code == 2, (code, out, err)
    assert "checkpoints they would continue from are gone" in err, err
    assert (f"job 'first': max_steps raised 3 -> 5, but its checkpoint at step 3 is no longer in its folder "
            f"{tmp_path / 'out/first'} (deleted, moved or damaged)") in err, err
    assert "put each checkpoint back" in err and "--overwrite to start 'first' over from step 0" in err, err
    assert "mix two configurations" not in err and "spec or data differ" not in err, err
    assert metric_steps(tmp_path / "out/first") == [1, 2, 3]   # nothing was touched

    code, out, err = run(tmp_path, "--in-process", "--overwrite", env=NO_RAY)
    assert code == 0, (out, err)
    assert "first: started over from step 0 (--overwrite: its checkpoint at step 3 is gone)" in out, out
    assert "second: already completed at step 3; left alone" in out, out
    assert metric_steps(tmp_path / "out/first") == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "out/first/checkpoint/state.json").read_text())["step"] == 5
    assert (tmp_path / "out/second/adapter_model.safetensors").read_bytes() == second


def test_an_unfinished_job_whose_checkpoint_is_gone_is_not_said_to_resume(tmp_path):
    """An unchanged paused job whose table records a checkpoint no longer on disk: the run stopped saying it
    resumed from its checkpoint, then trained it from step 0; now it stops naming it (`--overwrite` starts it
    over), while one whose checkpoint is there resumes and one that never checkpointed starts again."""
    def spec() -> RunSpec:
        return RunSpec(output_dir=tmp_path, jobs=[{"name": name, "data": "data.jsonl", "format": {"type": "text"},
                                                   "max_steps": 10} for name in ("kept", "gone", "never")])

    before = spec().submissions()
    stored = {f"id-{s.job.name}": s for s in before}
    records = [_record(before[0], "paused", 4, step=5), _record(before[1], "paused", 4, step=5),
               _record(before[2], "failed", None, step=0)]
    on_disk = {str(before[0].output_dir): 4}
    plan = plan_run(spec().submissions(), records, stored.__getitem__, saved_step=on_disk.get)
    assert [r.name for r in plan.resume] == ["kept", "never"] and [r.name for r in plan.started_over] == ["gone"]
    assert [(record.name, why) for record, why in plan.lost] == [
        ("gone", f"paused at step 5, but its checkpoint at step 4 is no longer in its folder {before[1].output_dir} "
                 "(deleted, moved or damaged), so it cannot resume from it")]
