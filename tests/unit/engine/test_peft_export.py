"""A saved adapter's PEFT config names exactly the layers it was trained on: PEFT, loading it on the same
base, puts LoRA on those layers and no others and computes the engine's logits. And the config file is the
one PEFT itself writes for the same LoraConfig (DoRA, rsLoRA, the init kinds, all-linear, the base id)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from actors.checkpoint.peft_io import CONFIG_NAME, save_adapter
from actors.engine.adapter_surgery import add_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module, load_base_model
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from tests.helpers.models import random_examples, tiny_model


def adapted_layers(model: PeftModel) -> list[str]:
    return sorted(name.removeprefix("base_model.model.") for name, module in model.named_modules()
                  if hasattr(module, "lora_A") and len(module.lora_A) > 0)


def test_per_module_targets_reach_peft_as_trained(tiny_model_dirs, tmp_path):
    folder = tiny_model_dirs["llama"]
    base = load_base_model(str(folder), device="cpu")
    targets = ["layers.0.self_attn.q_proj", "v_proj", "layers.1.mlp.down_proj"]
    spec = JobSpec(name="some-layers", data="unused.jsonl", format={"type": "text"}, batch_size=3, max_steps=3,
                   lr=2e-2, lora={"r": 4, "alpha": 8, "target_modules": targets})
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, random_examples(3), [], seed=3)
    trainer.add_job(job)
    while trainer.train_step() is not None:
        pass
    save_adapter(job.adapter, tmp_path / "adapter", str(folder))
    config = json.loads((tmp_path / "adapter" / CONFIG_NAME).read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "v_proj"]

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    assert adapted_layers(peft_model) == sorted(job.adapter.layers)
    ids = torch.tensor([random_examples(9, count=1, min_len=20, max_len=20)[0].input_ids])
    with torch.no_grad():
        assert (trainer.logits("some-layers", ids) - peft_model(input_ids=ids).logits).abs().max() <= 1e-5


# aspen's LoraConfig fields -> PEFT's (PEFT's defaults where aspen's are the same)
CONFIGS = {
    "default": ({}, {}),
    "dora+dropout": ({"use_dora": True, "dropout": 0.1}, {"use_dora": True, "lora_dropout": 0.1}),
    "rslora": ({"use_rslora": True, "alpha": 12.0}, {"use_rslora": True, "lora_alpha": 12.0}),
    "gaussian": ({"init_lora_weights": "gaussian"}, {"init_lora_weights": "gaussian"}),
    "all-linear": ({"target_modules": "all-linear"}, {"target_modules": "all-linear"}),
    "pissa": ({"init_lora_weights": "pissa"}, {"init_lora_weights": "pissa"}),
    "olora+rslora+dora": ({"init_lora_weights": "olora", "use_rslora": True, "use_dora": True},
                          {"init_lora_weights": "olora", "use_rslora": True, "use_dora": True}),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_saved_config_is_what_peft_saves(kind, tmp_path):
    """adapter_config.json equals what PEFT's own `save_pretrained` writes for a PEFT model made with the same
    LoraConfig; for PiSSA / OLoRA, what PEFT's conversion to a plain LoRA writes (the form aspen saves)."""
    ours, theirs = CONFIGS[kind]
    settings = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "down_proj"], **ours}
    base = from_module(tiny_model("llama"), None)
    handle = add_adapter(base.model, "job", LoraConfig(**settings), seed=0)
    save_adapter(handle, tmp_path / "aspen", "org/tiny-base")

    peft_settings = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "down_proj"], **theirs}
    reference = tiny_model("llama")
    reference.name_or_path = "org/tiny-base"     # as a model loaded by its hub id has it; PEFT records it
    peft_model = get_peft_model(reference, PeftLoraConfig(task_type="CAUSAL_LM", **peft_settings))
    if theirs.get("init_lora_weights") in ("pissa", "olora"):   # PEFT's documented conversion
        peft_model.peft_config["default"].init_lora_weights = True
        peft_model.save_pretrained(tmp_path / "initial")
        peft_model.peft_config["default"].init_lora_weights = theirs["init_lora_weights"]
        peft_model.save_pretrained(tmp_path / "peft", path_initial_model_for_weight_conversion=tmp_path / "initial")
    else:
        peft_model.save_pretrained(tmp_path / "peft")

    written = json.loads((tmp_path / "aspen" / CONFIG_NAME).read_text())
    expected = json.loads((tmp_path / "peft" / CONFIG_NAME).read_text())
    targets, peft_targets = written.pop("target_modules"), expected.pop("target_modules")
    assert written == expected
    # the same layers: PEFT, loading aspen's folder, adapts exactly those its own model adapted
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "aspen")
    assert adapted_layers(loaded) == adapted_layers(peft_model)
    # spelled as PEFT spells them (its set in any order, aspen's sorted), except that PEFT writes all-linear
    # as every layer's full path and aspen as the short names that select every layer
    if kind != "all-linear":
        assert targets == sorted(peft_targets)
    else:
        assert targets == sorted({name.rsplit(".", 1)[-1] for name in peft_targets})
