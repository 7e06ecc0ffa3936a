"""A job folder holding another run's outputs (its adapter, checkpoint, metrics) that no job of the service's table
wrote there (the folder copied or moved, its table deleted, its job forgotten) is refused to a new job (409),
naming what was found and what to do, and nothing of it is overwritten; a folder holding other files only is
written to as before (actors/service/outputs/earlier_outputs.py, actors/service/scheduler/submissions.py)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from actors.service.outputs.earlier_outputs import earlier_outputs
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.scheduler_core import SchedulerCore, SubmissionConflict
from actors.service.table.job_table import JobTable
from policies.fifo import FifoPolicy
from tests.helpers.keep_best import eval_losses, overfitting_job
from tests.helpers.service import job_dict, run_spec, write_task_data

STEPS = 3


@pytest.fixture()
def trained(tmp_path, tiny_base, tiny_model_dirs) -> Path:
    """A run folder whose job 'a' trained STEPS steps in this process, checkpointed at each."""
    data = write_task_data(tmp_path / "data", "a")
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, STEPS, checkpoint_every=1)],
                    step_tokens=512)
    [summary] = train_locally(spec, base=tiny_base, progress=False)
    assert summary.state == "completed" and summary.steps == STEPS
    return tmp_path / "out"


def digests(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def core_of(tmp_path: Path) -> SchedulerCore:
    return SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), FifoPolicy(), tmp_path / "state")


def test_what_a_trained_folder_holds_is_named_with_its_job_and_step(trained):
    found = earlier_outputs(trained / "a")
    assert found is not None and found.job == "a" and found.step == STEPS and found.checkpoint_step == STEPS
    text = found.describe()
    assert text.startswith(f"job 'a' at step {STEPS}: its adapter (aspen.json), a checkpoint at step {STEPS}, "
                           f"metrics.jsonl ({STEPS} rows); last written "), text
    # what makes a folder aspen's, each alone
    alone = trained.parent / "alone"
    (alone / "checkpoint").mkdir(parents=True)
    (alone / "checkpoint/state.json").write_text("{not json")
    assert earlier_outputs(alone).found == ["a checkpoint (not readable)"]
    shutil.rmtree(alone / "checkpoint")
    (alone / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert earlier_outputs(alone).found == ["metrics.jsonl (1 rows)"]
    (alone / "metrics.jsonl").write_text("")   # a job that failed before its first step: nothing to lose
    assert earlier_outputs(alone) is None
    assert earlier_outputs(trained.parent / "absent") is None


def test_a_copied_folder_is_refused_to_a_new_job_and_left_as_it_was(tmp_path, trained, tiny_model_dirs):
    """`cp -r out out2`, then the same job submitted to write to out2/a: no job of the table wrote there, so the
    service refuses it (409), saying whose outputs they are, at which step, and what to do; nothing is entered."""
    shutil.copytree(trained, tmp_path / "out2")
    before = digests(tmp_path / "out2")
    data = tmp_path / "data/a.jsonl"
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out2", [job_dict("a", data, STEPS)], step_tokens=512)
    core = core_of(tmp_path)
    with pytest.raises(SubmissionConflict) as refused:
        core.submit_many(spec.submissions())
    message = str(refused.value)
    assert f"{(tmp_path / 'out2/a').resolve()} holds the outputs of a job this service has no record of (job 'a' at " \
           f"step {STEPS}: its adapter (aspen.json), a checkpoint at step {STEPS}" in message, message
    assert "Give this job another output_dir" in message and "delete those files first" in message, message
    assert core.table.all() == []
    assert digests(tmp_path / "out2") == before
    # the same folder with only other files in it (a README, its data): written to as before
    shutil.rmtree(tmp_path / "out2/a")
    (tmp_path / "out2/a").mkdir()
    (tmp_path / "out2/a/README.md").write_text("notes\n")
    [record] = core.submit_many(spec.submissions())
    assert record.state == "queued" and record.output_dir == str((tmp_path / "out2/a").resolve())


def test_a_forgotten_jobs_outputs_are_not_trained_over_until_deleted(tmp_path, trained, tiny_model_dirs):
    """Forgetting a job (`Client.delete`) keeps its files, and a new job is not given them to overwrite: the folder
    is refused while its outputs are there, and free once they are deleted."""
    data = tmp_path / "data/a.jsonl"
    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [job_dict("a", data, STEPS)], step_tokens=512)
    core = core_of(tmp_path)
    [first] = core.submit_many(spec.submissions(), starts_over=True)   # as train_locally: it clears the folder
    core.table.set_state(first.id, "completed", "trained")
    core.delete(first.id)
    with pytest.raises(SubmissionConflict, match="or left by a job forgotten since; this job would train over them"):
        core.submit_many(spec.submissions())
    assert (trained / "a/adapter_model.safetensors").is_file()
    for path in (trained / "a").iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    [again] = core.submit_many(spec.submissions())
    assert again.output_dir == first.output_dir and again.state == "queued"


def test_a_keep_best_jobs_copied_folder_is_named_with_the_step_it_trained_to_and_its_adapters(tmp_path,
                                                                                            memorising_model):
    """A keep_best job that overfits ends with its best evaluation's adapter (an earlier step's) and trained on past
    it: the 409 of its copied folder says the step it trained to (its checkpoint's, aspen.json's last_step) and the
    kept adapter's step, as its metrics.jsonl and its end's reason give them, not "at step <the kept step>"."""
    job = overfitting_job(tmp_path / "data", 60, keep_best="eval_loss", early_stop={"patience": 3})
    (summary,) = train_locally(run_spec(str(memorising_model), tmp_path / "out", [job]), progress=False)
    losses = eval_losses(tmp_path / "out/fit")
    best_step = min(losses, key=lambda step: (losses[step], step))
    assert best_step < summary.steps, (summary.steps, losses)
    shutil.copytree(tmp_path / "out", tmp_path / "out2")
    before = digests(tmp_path / "out2")
    core = core_of(tmp_path)
    with pytest.raises(SubmissionConflict) as refused:
        core.submit_many(run_spec(str(memorising_model), tmp_path / "out2", [job]).submissions())
    message = str(refused.value)
    assert (f"(job 'fit', trained to step {summary.steps} (its adapter the best eval loss's, step {best_step}): its "
            f"adapter (aspen.json), a checkpoint at step {summary.steps}, metrics.jsonl ({summary.steps} rows); "
            "last written ") in message, message
    assert f"at step {best_step}" not in message, message
    assert core.table.all() == [] and digests(tmp_path / "out2") == before
