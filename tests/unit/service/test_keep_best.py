"""`keep_best:` (transformers' load_best_model_at_end): a job that overfits ends with the adapter of its best
evaluation, which is what the same job trained only to that step ends with (a solo run, the reference), loads in
PEFT, and survives a pause and resume; its checkpoint keeps the last step's weights. A jobs file asking for it
without evaluations is refused at its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from actors.service.scheduler.local_run import train_locally
from orchestrator.jobs_file import SpecError, load_run_spec
from tests.helpers.keep_best import eval_losses, overfitting_job, paused_then_resumed
from tests.helpers.service import adapter_tensors, run_spec


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def test_an_overfitting_job_ends_with_its_best_evaluations_adapter(tmp_path, memorising_model):
    """Stopped early by its plateau (patience 3), the job's folder holds the adapter of its lowest eval loss, the
    same tensors as the job trained to that step alone; PEFT loads it; its checkpoint holds the last step's."""
    job = overfitting_job(tmp_path / "data", 60, keep_best="eval_loss", early_stop={"patience": 3})
    (summary,) = train_locally(run_spec(str(memorising_model), tmp_path / "out", [job]), progress=False)
    losses = eval_losses(tmp_path / "out/fit")
    best_step = min(losses, key=lambda step: (losses[step], step))
    assert summary.state == "stopped_early" and best_step < summary.steps, (summary.steps, losses)
    assert losses[summary.steps] > losses[best_step]   # it did overfit: what it ended with is worse
    assert (f"its adapter is step {best_step}'s, its best evaluation (eval loss {losses[best_step]:.4g}); its last "
            f"step's ({summary.steps}) is in its checkpoint") in summary.reason, summary.reason
    facts = json.loads((tmp_path / "out/fit/aspen.json").read_text())
    assert facts["step"] == best_step and facts["last_step"] == summary.steps
    assert facts["best"] == {"metric": "eval_loss", "step": best_step, "value": losses[best_step]}

    reference = {key: value for key, value in job.items() if key not in ("keep_best", "early_stop")}
    train_locally(run_spec(str(memorising_model), tmp_path / "solo", [reference | {"max_steps": best_step}]),
                  progress=False)
    assert_same_tensors(adapter_tensors(tmp_path / "out/fit"), adapter_tensors(tmp_path / "solo/fit"))
    state = json.loads((tmp_path / "out/fit/checkpoint/state.json").read_text())
    assert state["step"] == summary.steps and state["best"]["step"] == best_step
    last = adapter_tensors(tmp_path / "out/fit/checkpoint")
    assert any(not torch.equal(last[key], tensor) for key, tensor in adapter_tensors(tmp_path / "out/fit").items())

    base = AutoModelForCausalLM.from_pretrained(memorising_model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, tmp_path / "out/fit")
    loaded = {name: param for name, param in peft.named_parameters() if "lora_" in name}
    assert len(loaded) == len(adapter_tensors(tmp_path / "out/fit"))

    # admission counts the host copy where the budget is the host's (a CPU trainer): the bytes the kept copy has
    # (its file holds exactly those tensors), and nothing on a GPU, whose budget the copy is not in
    from actors.engine.adapter_surgery import linear_module_names
    from actors.service.scheduler.job_fit import job_adapter_bytes
    from actors.spec.lora_config import LoraConfig
    from policies.base import TrainerView

    plain = AutoModelForCausalLM.from_pretrained(memorising_model, dtype=torch.float32)
    shapes = tuple((name, plain.get_submodule(name).in_features, plain.get_submodule(name).out_features)
                   for name in linear_module_names(plain))
    lora = LoraConfig.model_validate(job["lora"])
    views = [TrainerView(id="t", base_model="m", quantization="none", memory_budget_bytes=2**40, base_bytes=0,
                         step_memory_bytes=0, jobs=(), linear_shapes=shapes, host_budget=host)
             for host in (True, False)]
    kept = sum(tensor.numel() * tensor.element_size() for tensor in adapter_tensors(tmp_path / "out/fit").values())
    assert [job_adapter_bytes(lora, view, keep_best=True) - job_adapter_bytes(lora, view) for view in views] == \
        [kept, 0]


def test_keep_best_eval_score_keeps_the_adapter_of_the_highest_generation_score(tmp_path, memorising_model):
    """With eval_generate (a metric of the user's that scores a continuation by its length), `keep_best:
    eval_score` keeps the adapter of the highest score (the first of equal ones), as the job trained to that
    step alone ends with."""
    metric = {"metric": "tests.helpers.metrics:recorded", "max_new_tokens": 6}
    job = overfitting_job(tmp_path / "data", 12, keep_best="eval_score", eval_generate=metric)
    (summary,) = train_locally(run_spec(str(memorising_model), tmp_path / "out", [job]), progress=False)
    scores = eval_losses(tmp_path / "out/fit", "eval_score")
    best_step = max(scores, key=lambda step: (scores[step], -step))
    assert json.loads((tmp_path / "out/fit/aspen.json").read_text())["best"] == {
        "metric": "eval_score", "step": best_step, "value": scores[best_step]}
    assert f"(eval score {scores[best_step]:.4g})" in summary.reason, summary.reason
    reference = {key: value for key, value in job.items() if key != "keep_best"} | {"max_steps": best_step}
    train_locally(run_spec(str(memorising_model), tmp_path / "solo", [reference]), progress=False)
    assert_same_tensors(adapter_tensors(tmp_path / "out/fit"), adapter_tensors(tmp_path / "solo/fit"))


@pytest.mark.parametrize("pause_after", [6, 14], ids=["before-the-best", "after-the-best"])
def test_a_job_paused_and_resumed_keeps_the_same_best(tmp_path, memorising_model, pause_after):
    """Paused (a checkpoint written) before or after its best evaluation and resumed in a new trainer loop, the
    job ends with the adapter the uninterrupted job ends with: the best so far comes back with the checkpoint."""
    job = overfitting_job(tmp_path / "data", 20, keep_best="eval_loss")
    train_locally(run_spec(str(memorising_model), tmp_path / "whole", [job]), progress=False)
    losses = eval_losses(tmp_path / "whole/fit")
    assert 6 < min(losses, key=losses.get) < 14, losses   # the pauses fall on both sides of it
    _, events = paused_then_resumed(tmp_path, memorising_model, job, pause_after)
    assert next(e for e in events if e.kind == "started").data["resumed_from"] == pause_after
    assert eval_losses(tmp_path / "paused/fit") == losses
    assert_same_tensors(adapter_tensors(tmp_path / "paused/fit"), adapter_tensors(tmp_path / "whole/fit"))


def test_a_damaged_best_adapter_file_refuses_its_checkpoint_and_says_which_file(tmp_path, memorising_model):
    """A flipped byte in the checkpoint's best_adapter.safetensors: the job does not resume with a wrong best (nor
    on without one); as with any damaged checkpoint file it starts over, its start naming the file and what is
    wrong, and ends with the adapter the uninterrupted job ends with."""
    def flip(folder: Path) -> None:
        path = folder / "best_adapter.safetensors"
        content = bytearray(path.read_bytes())
        content[-1] ^= 0xFF
        path.write_bytes(bytes(content))

    job = overfitting_job(tmp_path / "data", 20, keep_best="eval_loss")
    train_locally(run_spec(str(memorising_model), tmp_path / "whole", [job]), progress=False)
    _, events = paused_then_resumed(tmp_path, memorising_model, job, 14, damage=flip)
    started = next(e for e in events if e.kind == "started")
    assert started.data["resumed_from"] == 0
    assert ("checkpoint/best_adapter.safetensors: its content differs from what was saved (sha256 mismatch: "
            "corrupted)") in started.data["checkpoint_note"], started.data
    assert [e.kind for e in events if e.kind in ("completed", "failed")] == ["completed"]
    assert_same_tensors(adapter_tensors(tmp_path / "paused/fit"), adapter_tensors(tmp_path / "whole/fit"))


JOBS = """\
base_model: smollm2-135m
output_dir: runs
jobs:
  - name: fit
    data: rows.jsonl
    format: {{type: prompt_response, prompt: "{{question}}", response: " {{answer}}"}}
    max_steps: 50
{extra}"""


@pytest.mark.parametrize("extra,expected", [
    ("    keep_best: eval_loss\n",
     r"jobs.yaml:8: job 'fit' \(jobs\[0\]\), field keep_best: 'eval_loss' keeps the adapter of the job's best "
     r"evaluation, and the job has no eval_split and eval_every: set eval_split and eval_every"),
    ("    eval_split: 4\n    keep_best: eval_loss\n",
     r"the job has no eval_every: set eval_every \(e\.g\. eval_split: 64, eval_every: 50\), or remove keep_best"),
    ("    eval_split: 4\n    eval_every: 5\n    keep_best: eval_score\n",
     r"field keep_best: 'eval_score' keeps the adapter of the best eval_generate score, and the job has no "
     r"eval_generate"),
    ("    keep_best: lowest\n", r"field keep_best: .*'eval_loss' or 'eval_score'"),
], ids=["no-evaluations", "no-eval-every", "no-eval-generate", "unknown-metric"])
def test_keep_best_without_the_evaluations_it_compares_is_refused_at_its_line(tmp_path, extra, expected):
    (tmp_path / "rows.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    (tmp_path / "jobs.yaml").write_text(JOBS.format(extra=extra))
    with pytest.raises(SpecError, match=expected):
        load_run_spec(tmp_path / "jobs.yaml")
