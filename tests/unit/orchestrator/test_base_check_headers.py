"""`aspen run`'s check of `lora.target_modules` answers the common case (every name a layer of the base's checkpoint)
from the safetensors headers alone, without the process that builds the base on `meta` (seconds of CPU each run):
the layers the headers name are exactly the linear layers a trainer loads (the reference: the loaded model), a name
they lack goes to the full check, and a MoE base (whose mlp names aspen may leave alone) always does."""

from __future__ import annotations

import json
import shutil

import pytest

from orchestrator import base_check, target_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_headers_name_the_linear_layers_a_trainer_loads(tiny_model_dirs, arch):
    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.models import load_base_model

    base = tiny_model_dirs[arch]
    loaded = load_base_model(str(base), dtype="float32", device="cpu").model
    assert target_layers.checkpoint_layers(str(base)) == set(linear_module_names(loaded))


def test_names_the_base_has_need_no_process_and_a_typo_gets_the_full_check(tiny_model_dirs, monkeypatch):
    base = str(tiny_model_dirs["llama"])
    assert target_layers._all_in_checkpoint(base, ["q_proj", "v_proj", "self_attn.o_proj", "down_proj"])
    assert not target_layers._all_in_checkpoint(base, ["q_proj", "q_projj"])
    assert not target_layers._all_in_checkpoint(base, ["embed_tokens"])   # not a linear layer: the full check says so

    def no_process(*args, **kwargs):
        raise AssertionError("the base was built in a process of its own for names its checkpoint has")

    monkeypatch.setattr(target_layers.subprocess, "run", no_process)
    from actors.spec.run_spec import RunSpec

    spec = RunSpec.model_validate({"base_model": base, "jobs": [
        {"name": "a", "data": "d.jsonl", "format": "text", "lora": {"target_modules": ["q_proj", "v_proj"]}}]})
    base_check.check_target_modules(spec, "jobs.yaml")   # answered from the headers: no process, no refusal


def test_a_moe_config_is_left_to_the_full_check(tiny_model_dirs, tmp_path):
    base = tmp_path / "moe-like"
    shutil.copytree(tiny_model_dirs["llama"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "num_local_experts": 4}))
    assert target_layers.checkpoint_layers(str(base)) is None
    assert target_layers.checkpoint_layers(str(tmp_path / "missing")) is None


def test_a_moe_bases_mlp_names_are_refused_before_the_start_as_its_trainer_refuses_them(tmp_path):
    """On a MoE type whose mlp names PEFT reads as the experts', the check before anything starts (the model on
    meta, in a process of its own, its layers kept) says what a trainer's job says of `down_proj` (the reference:
    TrainingJob's refusal on the loaded base), and takes attention."""
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.spec.job_spec import JobSpec
    from tests.helpers.model_families import build_config, build_model, examples

    model = build_model(build_config("qwen3_moe"))
    model.save_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError) as trainer:
        TrainingJob.create(JobSpec(name="mlp", data="unused.jsonl", format={"type": "text"}, batch_size=1, max_steps=1,
                                   lr=1e-3, lora={"r": 2, "target_modules": ["down_proj"]}),
                           from_module(model, None), examples(0, [10]), [], seed=0)
    found = target_layers.target_problems(str(tmp_path / "moe"), ["down_proj", "q_proj"])
    assert found == {"down_proj": str(trainer.value), "q_proj": None}
