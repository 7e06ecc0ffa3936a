"""A saved adapter's PEFT config names exactly the layers it was trained on: PEFT, loading it on the same
base, puts LoRA on those layers and no others and computes the engine's logits."""

from __future__ import annotations

import json

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from actors.engine.job import TrainingJob
from actors.engine.models import load_base_model
from actors.engine.peft_io import CONFIG_NAME, save_adapter
from actors.engine.spec import JobSpec
from actors.engine.trainer import FusedTrainer
from tests.conftest import random_examples


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
    adapted = sorted(name.removeprefix("base_model.model.") for name, module in peft_model.named_modules()
                     if hasattr(module, "lora_A") and len(module.lora_A) > 0)
    assert adapted == sorted(job.adapter.layers)
    ids = torch.tensor([random_examples(9, count=1, min_len=20, max_len=20)[0].input_ids])
    with torch.no_grad():
        assert (trainer.logits("some-layers", ids) - peft_model(input_ids=ids).logits).abs().max() <= 1e-5
