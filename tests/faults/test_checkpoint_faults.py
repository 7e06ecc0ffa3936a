"""Checkpoints under real faults, on real files, against an uninterrupted run: a crash in the middle of
the swap (in-process and a killed process), truncated and corrupted files, step numbers that disagree,
planted pickles, and the fsyncs that make the swap durable."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from actors.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    has_checkpoint,
    load_checkpoint,
    previous_folder,
    save_checkpoint,
)
from tests.helpers.checkpoint_run import A_MICRO_BATCHES, B_MICRO_BATCHES, Run, resume
from tests.helpers.checkpoints import weights, write_format_1
from tests.helpers.models import REPO


class SimulatedCrash(BaseException):
    """Stands for the process dying at that instant (not an Exception: nothing may handle it as one)."""


@pytest.fixture(scope="module")
def uninterrupted() -> tuple[dict[str, torch.Tensor], list[float]]:
    job = Run().train_to().job
    assert job.step == 8
    return weights(job), [record.loss for record in job.history]


def assert_ends_like_uninterrupted(run: Run, uninterrupted) -> None:
    reference, losses = uninterrupted
    run.train_to()
    assert run.job.step == 8
    assert [record.loss for record in run.job.history] == losses
    final = weights(run.job)
    for key, value in reference.items():
        torch.testing.assert_close(final[key], value, rtol=1e-5, atol=1e-7)


def two_checkpoints(tmp_path: Path, monkeypatch) -> Path:
    """`ckpt` = B (step 2) and `.ckpt.previous` = A (step 1): the save of B died after its swap, before it
    deleted `.previous`."""
    folder = tmp_path / "ckpt"
    run = Run().train_to(A_MICRO_BATCHES)
    save_checkpoint(run.job, folder, "tiny")
    run.train_to(B_MICRO_BATCHES)
    real_rmtree = shutil.rmtree

    def dying_rmtree(path, *args, **kwargs):
        if Path(path) == previous_folder(folder):
            raise SimulatedCrash(f"killed while deleting {path}")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", dying_rmtree)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(run.job, folder, "tiny")
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert step_of(folder) == 2 and step_of(previous_folder(folder)) == 1
    return folder


def step_of(folder: Path) -> int:
    return json.loads((folder / "state.json").read_text())["step"]


def truncate(path: Path) -> None:
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])


def flip_last_bytes(path: Path) -> None:
    content = path.read_bytes()
    path.write_bytes(content[:-8] + bytes(b ^ 0xFF for b in content[-8:]))


# -------------------------------------------------------------------------------------- crash in the swap


def test_a_crash_between_the_two_renames_resumes_from_the_previous_checkpoint(tmp_path, monkeypatch,
                                                                               uninterrupted):
    folder = tmp_path / "ckpt"
    run = Run().train_to(A_MICRO_BATCHES)
    save_checkpoint(run.job, folder, "tiny")
    run.train_to(B_MICRO_BATCHES)
    real_replace = os.replace
    renames: list[tuple[str, str]] = []

    def dying_replace(src, dst, *args, **kwargs):
        if Path(src).name.startswith(".ckpt.staging-") and Path(dst) == folder:
            raise SimulatedCrash("killed between the two renames")
        renames.append((Path(src).name, Path(dst).name))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(SimulatedCrash):
        save_checkpoint(run.job, folder, "tiny")
    monkeypatch.setattr(os, "replace", real_replace)

    assert ("ckpt", ".ckpt.previous") in renames  # the first rename happened
    assert not folder.exists()
    assert step_of(previous_folder(folder)) == 1
    assert has_checkpoint(folder)
    resumed, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1 and loaded.format == 2
    assert loaded.skipped == [f"{folder}: missing"]
    assert resumed.job.accumulator.micro_batches == 1
    assert_ends_like_uninterrupted(resumed, uninterrupted)


CHILD = """
import os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.helpers.checkpoint_run import A_MICRO_BATCHES, B_MICRO_BATCHES, Run, resume
from actors.checkpoint import save_checkpoint
folder = Path({folder!r})
run = Run().train_to(A_MICRO_BATCHES)
save_checkpoint(run.job, folder, "tiny")
run.train_to(B_MICRO_BATCHES)
real_replace = os.replace
def dying_replace(src, dst, *args, **kwargs):
    if Path(src).name.startswith(".ckpt.staging-"):
        os._exit(17)  # the process dies here: no cleanup, no finally
    return real_replace(src, dst, *args, **kwargs)
os.replace = dying_replace
save_checkpoint(run.job, folder, "tiny")
sys.exit(0)
"""


def test_a_killed_save_leaves_a_loadable_previous_and_its_staging_is_cleaned_at_the_next_save(
        tmp_path, uninterrupted):
    folder = tmp_path / "ckpt"
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD.format(repo=str(REPO), folder=str(folder)))],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert child.returncode == 17, child.stderr
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.staging-")]
    assert len(stale) == 1 and (stale[0] / "state.json").is_file()  # left behind by the dead process
    assert not folder.exists() and step_of(previous_folder(folder)) == 1

    resumed, loaded = resume(folder)
    assert loaded == LoadedCheckpoint(step=1, folder=previous_folder(folder), skipped=[f"{folder}: missing"])
    assert_ends_like_uninterrupted(resumed, uninterrupted)
    save_checkpoint(resumed.job, folder, "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # stale staging and .previous gone
    assert step_of(folder) == 8


# --------------------------------------------------------------------------------- damaged checkpoints


def test_a_truncated_state_file_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch, uninterrupted):
    folder = two_checkpoints(tmp_path, monkeypatch)
    truncate(folder / "state.json")
    resumed, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'state.json'}: truncated JSON (")
    assert_ends_like_uninterrupted(resumed, uninterrupted)


@pytest.mark.parametrize("damage, problem", [
    (truncate, "truncated or corrupted safetensors file"),
    (flip_last_bytes, "sha256 mismatch"),  # same size, still parses
    (lambda path: path.write_bytes(b"\x00" * 64), "truncated or corrupted safetensors file"),
    (os.remove, "missing"),
], ids=["truncated", "bytes-flipped", "garbage", "deleted"])
def test_a_damaged_optimizer_file_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch, uninterrupted,
                                                                        damage, problem):
    folder = two_checkpoints(tmp_path, monkeypatch)
    damage(folder / "optimizer.safetensors")
    resumed, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'optimizer.safetensors'}: ") and problem in message
    assert_ends_like_uninterrupted(resumed, uninterrupted)


def test_when_both_checkpoints_are_bad_the_error_names_both_and_the_job_is_untouched(tmp_path, monkeypatch):
    folder = two_checkpoints(tmp_path, monkeypatch)
    truncate(folder / "state.json")
    truncate(previous_folder(folder) / "optimizer.safetensors")
    run = Run()
    before = weights(run.job), run.job.cursor.state_dict()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(run.job, folder)
    message = str(error.value)
    assert f"{folder / 'state.json'}: truncated JSON" in message
    assert f"{previous_folder(folder) / 'optimizer.safetensors'}: truncated or corrupted safetensors" in message
    assert isinstance(error.value, ValueError)
    after = weights(run.job)
    assert all(torch.equal(after[key], value) for key, value in before[0].items())
    assert run.job.cursor.state_dict() == before[1] and run.job.step == 0 and run.job.history == []
    assert run.job.optimizer.optimizer.state_dict()["state"] == {}
    assert all(p.grad is None for p in run.job.adapter.parameters())


def test_no_checkpoint_at_all_names_both_candidates(tmp_path):
    run = Run()
    assert not has_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"ckpt: missing; .*\.ckpt\.previous: missing"):
        load_checkpoint(run.job, tmp_path / "ckpt")


@pytest.mark.parametrize("edit, problem", [
    (lambda state: state.update(step=3), "step 3 but the optimizer state is at step 2"),
    (lambda state: state["history"][-1].update(step=5), "step 2 but the last history record is of step 5"),
    (lambda state: [state["optimizer"].update(step_count=3), state.update(step=3),
                    state["history"][-1].update(step=3)],
     "the optimizer state is at step 2, the job at step 3"),
    (lambda state: state.update(evals=[[1, 2.5], [5, 2.4]]), "evals entry 1 is [5, 2.4], not [step <= 2, value]"),
    (lambda state: state.update(scores=[[3, 0.5]]), "scores entry 0 is [3, 0.5], not [step <= 2, value]"),
], ids=["state-step", "history-step", "optimizer-step-count", "eval-after-the-step", "score-after-the-step"])
def test_step_numbers_that_disagree_are_rejected(tmp_path, monkeypatch, uninterrupted, edit, problem):
    folder = two_checkpoints(tmp_path, monkeypatch)
    state = json.loads((folder / "state.json").read_text())
    edit(state)
    (folder / "state.json").write_text(json.dumps(state))
    resumed, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert problem in message and str(folder) in message
    assert_ends_like_uninterrupted(resumed, uninterrupted)


def test_a_data_position_that_does_not_fit_the_data_falls_back_and_leaves_the_cursor_alone(
        tmp_path, monkeypatch, uninterrupted):
    folder = two_checkpoints(tmp_path, monkeypatch)
    state = json.loads((folder / "state.json").read_text())
    state["cursor"]["num_examples"] = 11  # saved for another dataset
    (folder / "state.json").write_text(json.dumps(state))
    resumed, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'state.json'}: its data position does not fit this job's data (")
    assert_ends_like_uninterrupted(resumed, uninterrupted)


# ------------------------------------------------------------------------------------------- no pickle


class Payload:
    """Unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path: Path, marker: Path) -> None:
    torch.save({"optimizer": Payload(marker), "gradients": [], "dropout_rng": None}, path)


def test_the_planted_pickle_is_live(tmp_path):
    """The payload of the tests below does run when unpickled (so their markers prove something)."""
    marker = tmp_path / "marker"
    plant(tmp_path / "optimizer.pt", marker)
    torch.load(tmp_path / "optimizer.pt", weights_only=False)
    assert marker.exists()


def test_a_pickle_planted_in_a_format_2_checkpoint_is_never_opened(tmp_path, monkeypatch, uninterrupted):
    folder = two_checkpoints(tmp_path, monkeypatch)
    marker = tmp_path / "pwned"
    plant(folder / "optimizer.pt", marker)
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a format-2 load called torch.load"))
    resumed, loaded = resume(folder)
    assert loaded == LoadedCheckpoint(step=2, folder=folder, skipped=[], format=2)
    assert not marker.exists()
    assert_ends_like_uninterrupted(resumed, uninterrupted)
    assert not marker.exists()


def test_a_format_1_checkpoint_holding_a_pickle_is_refused(tmp_path, monkeypatch, uninterrupted):
    folder = two_checkpoints(tmp_path, monkeypatch)
    marker = tmp_path / "pwned"
    shutil.rmtree(folder)
    write_format_1(Run().train_to(B_MICRO_BATCHES).job, folder)
    plant(folder / "optimizer.pt", marker)
    resumed, loaded = resume(folder)
    assert not marker.exists()
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'optimizer.pt'}: refused: ")
    assert_ends_like_uninterrupted(resumed, uninterrupted)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- durability


def test_the_staging_files_and_folders_are_synced_before_the_previous_checkpoint_is_deleted(tmp_path,
                                                                                           monkeypatch):
    folder = tmp_path / "ckpt"
    run = Run().train_to(A_MICRO_BATCHES)
    save_checkpoint(run.job, folder, "tiny")
    run.train_to(B_MICRO_BATCHES)
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd: int) -> None:
        events.append(("fsync", str(Path(os.readlink(f"/proc/self/fd/{fd}")))))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", str(Path(src).resolve()), str(Path(dst).resolve())))
        return real_replace(src, dst, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", str(Path(path).resolve())))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    save_checkpoint(run.job, folder, "tiny")
    monkeypatch.undo()

    parent, folder, previous = tmp_path.resolve(), folder.resolve(), previous_folder(folder).resolve()
    [swap] = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(folder)]
    staging = Path(events[swap][1])
    assert staging.parent == parent and staging.name.startswith(".ckpt.staging-")
    [keep] = [i for i, e in enumerate(events) if e == ("replace", str(folder), str(previous))]
    [delete] = [i for i, e in enumerate(events) if e == ("rmtree", str(previous))]
    synced = {e[1]: i for i, e in enumerate(events) if e[0] == "fsync"}  # the last fsync of each path
    files = sorted(p.name for p in folder.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "state.json"]
    for name in files:
        assert synced[str(staging / name)] < synced[str(staging)], name  # each file, then its folder
    assert synced[str(staging)] < keep < swap < delete
    parent_syncs = [i for i, e in enumerate(events) if e == ("fsync", str(parent))]
    assert any(keep < i < swap for i in parent_syncs)  # the first rename is durable before the second
    assert any(swap < i < delete for i in parent_syncs)  # the swap is durable before .previous goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
