"""A checkpoint's state.json with a wrong field, on real files: each damage (a wrong type, a NaN where a number
must be finite, an unknown or missing key, a malformed digest, parameter ids that disagree) falls back to the
previous checkpoint with a message naming the file and the field; keys a later aspen adds are ignored; a
diverged job's NaN and inf losses are not damage and resume as they were."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from actors.checkpoint import (
    LoadedCheckpoint,
    previous_folder,
    save_checkpoint,
    saved_step,
)
from tests.helpers.checkpoint_run import A_MICRO_BATCHES, B_MICRO_BATCHES, Run, resume
from tests.helpers.checkpoints import write_format_1


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint at step 2 (B) and one at step 1 (A), written once for the cases below."""
    root = tmp_path_factory.mktemp("pair")
    run = Run().train_to(A_MICRO_BATCHES)
    save_checkpoint(run.job, root / "a", "tiny")
    run.train_to(B_MICRO_BATCHES)
    save_checkpoint(run.job, root / "b", "tiny")
    return root / "b", root / "a"


def with_state_edited(saved_pair: tuple[Path, Path], tmp_path: Path, edit) -> Path:
    """`ckpt` = B with `edit` applied to its state.json, `.ckpt.previous` = A as it was saved."""
    newest, older = saved_pair
    folder = tmp_path / "ckpt"
    shutil.copytree(newest, folder)
    shutil.copytree(older, previous_folder(folder))
    state = json.loads((folder / "state.json").read_text())
    edit(state)
    (folder / "state.json").write_text(json.dumps(state))
    return folder


def missing_keys(state: dict, *keys: str) -> None:
    for key in keys:
        del state[key]


# (edit, where and what the message says); "missed before": the hand-written checks resumed from it
@pytest.mark.parametrize("edit, problem", [
    (lambda state: state["history"][1].update(lr="0.01"),    # missed before
     'history[1].lr: Input should be a valid number (found "0.01")'),
    (lambda state: state["history"][1].update(lr=float("nan")),    # missed before
     "history[1].lr: Input should be a finite number (found NaN)"),
    (lambda state: state["history"][0].update(tokens=True),    # missed before
     "history[0].tokens: Input should be a valid integer (found true)"),
    (lambda state: state["history"][0].update(metrics={"rewards/chosen": "high"}),    # missed before
     'history[0].metrics["rewards/chosen"]: Input should be a valid number (found "high")'),
    (lambda state: state["accumulator"].update(micro_batches=1.5),    # missed before
     "accumulator.micro_batches: Input should be a valid integer (found 1.5)"),
    (lambda state: state.update(total_steps="8"),    # missed before
     'total_steps: Input should be a valid integer (found "8")'),
    (lambda state: state["history"][0].update(note="x"), "history[0].note: unknown key"),
    (lambda state: state["history"][0].pop("loss"), "history[0]: keys missing: loss"),
    (lambda state: state.update(step=-1), "step: Input should be greater than or equal to 0 (found -1)"),
    (lambda state: state.update(evals=[[1, "low"]]), 'evals[0][1]: Input should be a valid number (found "low")'),
    (lambda state: state["files"]["adapter_config.json"].update(sha256="not a digest"),
     'files["adapter_config.json"].sha256: String should match pattern'),
    (lambda state: state["files"].update({"notes.txt": {"bytes": 0, "sha256": "0" * 64}}),
     'files["notes.txt"]: unknown key'),
    (lambda state: [state["optimizer"][key].update(x=value) for key, value in
                    (("state_tensors", []), ("state_values", {}))],
     'optimizer.state_tensors.x (the key): "x" is not a parameter id (a whole number)'),
    (lambda state: state["optimizer"]["state_tensors"].update({"99": []}),
     "optimizer: state_tensors and state_values should list the same parameter ids (only in state_tensors: "
     "['99']; only in state_values: none)"),
    (lambda state: state["optimizer"].update(gradients=[1] * len(state["optimizer"]["gradients"])),
     "optimizer.gradients[0]: Input should be a valid boolean (found 1)"),
    (lambda state: missing_keys(state, "history", "files"), "keys missing: history, files"),
], ids=["lr-a-string", "lr-nan", "tokens-a-bool", "metric-a-string", "count-a-float", "total-steps-a-string",
        "unknown-history-key", "history-loss-missing", "negative-step", "eval-loss-a-string", "sha256-malformed",
        "unlisted-file", "parameter-id", "parameter-ids-disagree", "gradient-flags", "keys-missing"])
def test_a_state_file_with_a_wrong_field_falls_back_naming_the_file_and_the_field(saved_pair, tmp_path, edit,
                                                                                 problem):
    folder = with_state_edited(saved_pair, tmp_path, edit)
    _, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'state.json'}: {problem}"), message
    assert "\n" not in message
    assert saved_step(folder) == 1   # what a user is told agrees with what a resume uses


def test_a_top_level_key_this_aspen_does_not_know_is_ignored(saved_pair, tmp_path):
    """Within a format, later aspens add optional top-level keys (evals and data_digest came so); an aspen
    that does not know one still resumes the checkpoint, from that checkpoint."""
    folder = with_state_edited(saved_pair, tmp_path, lambda state: state.update(added_later={"x": [1, 2]}))
    resumed, loaded = resume(folder)
    assert loaded == LoadedCheckpoint(step=2, folder=folder, skipped=[], format=2)
    assert resumed.job.step == 2 and saved_step(folder) == 2


def test_a_diverged_jobs_nan_and_inf_losses_resume_as_they_were(saved_pair, tmp_path):
    """Not damage: a float16 job's skipped step records an inf gradient norm, a diverged job NaN losses; its
    checkpoint resumes with them, and the next save writes them back as they were."""
    nan, inf = float("nan"), float("inf")

    def diverge(state: dict) -> None:
        state["history"][0].update(loss=nan, grad_norm=inf)
        state["history"][1].update(loss=inf, grad_norm=nan)
        state["accumulator"]["loss_sum"] = nan
        state["evals"] = [[1, nan]]

    folder = with_state_edited(saved_pair, tmp_path, diverge)
    for _ in range(2):   # as edited, then as the resumed job saves it
        resumed, loaded = resume(folder)
        assert loaded == LoadedCheckpoint(step=2, folder=folder, skipped=[], format=2)
        first, second = resumed.job.history
        assert math.isnan(first.loss) and first.grad_norm == inf
        assert second.loss == inf and math.isnan(second.grad_norm)
        assert math.isnan(resumed.job.accumulator.loss_sum)
        [(step, loss)] = resumed.job.evals
        assert step == 1 and math.isnan(loss)
        save_checkpoint(resumed.job, folder, "tiny")


def test_a_format_1_optimizer_file_of_the_wrong_shape_is_refused_naming_the_field(saved_pair, tmp_path):
    folder = with_state_edited(saved_pair, tmp_path, lambda state: None)
    shutil.rmtree(folder)
    job = Run().train_to(B_MICRO_BATCHES).job
    write_format_1(job, folder, {"optimizer": job.optimizer.state_dict(), "gradients": ["not a tensor"],
                                 "dropout_rng": None})
    _, loaded = resume(folder)
    assert loaded.folder == previous_folder(folder) and loaded.step == 1
    [message] = loaded.skipped
    assert message.startswith(f"{folder / 'optimizer.pt'}: not a format-1 optimizer state "), message
    assert "gradients[0]: Input should be an instance of Tensor" in message
