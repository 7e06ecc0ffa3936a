"""Loading one pipeline stage's tensors only (actors/engine/pipeline/stage_loading.py), against the
independent reference of loading the whole base with `load_base_model` and cutting it: every tensor the
stage holds is equal, nothing else is materialised, and the stages chained compute the whole decoder; a
checkpoint that lacks a stage's tensor is refused naming it."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.engine.layout import step_layout
from actors.engine.models import load_base_model
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.pipeline.stage_loading import StageLoader, load_stage
from actors.engine.pipeline.stage_model import cut_stage
from tests.helpers.models import MODEL_CLASSES, random_examples, tiny_config

VOCAB = 300


def saved(folder, tied: bool, tokenizer, layers: int = 4):
    config = tiny_config("llama", VOCAB)
    config.num_hidden_layers, config.tie_word_embeddings = layers, tied
    torch.manual_seed(1)
    MODEL_CLASSES["llama"](config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def materialised(stage) -> dict[str, torch.Tensor]:
    return {name: p for name, p in stage.base.model.named_parameters(remove_duplicate=False) if not p.is_meta}


@pytest.mark.parametrize("tied", [False, True])
def test_each_stage_reads_exactly_its_own_tensors(tmp_path, tied, tiny_tokenizer):
    folder = saved(tmp_path / "model", tied, tiny_tokenizer)
    split = [1, 2, 1]
    whole = load_base_model(folder, device="cpu")
    batch = pack([JobMicroBatch("x", random_examples(3, count=3, vocab=VOCAB, min_len=10, max_len=30))])
    hidden = None
    for index in range(3):
        ours = load_stage(folder, split, index, device="cpu")
        theirs = cut_stage(copy.deepcopy(whole), split, index)
        mine, reference = materialised(ours), materialised(theirs)
        assert mine.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(mine[name], tensor), name
        layers = ours.base.decoder.layers
        assert [not layers[i].self_attn.q_proj.weight.is_meta for i in range(4)] == \
            [sum(split[:index]) <= i < sum(split[:index + 1]) for i in range(4)]
        with torch.no_grad(), step_layout(batch.layout):
            hidden = ours.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)
    with torch.no_grad(), step_layout(batch.layout):
        expected = whole.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                 attention_mask=None, use_cache=False).last_hidden_state[0]
    assert torch.equal(hidden, expected)


def test_a_checkpoint_without_a_stage_tensor_is_refused_naming_it(tmp_path, tiny_tokenizer):
    folder = tmp_path / "model"
    saved(folder, False, tiny_tokenizer)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    load_stage(str(folder), [2, 2], 0, device="cpu")   # stage 0 does not need it
    with pytest.raises(ValueError, match=r"lacks model\.layers\.2\.mlp\.down_proj\.weight"):
        load_stage(str(folder), [2, 2], 1, device="cpu")


def test_the_loader_tells_the_layers_and_loads_whole_or_a_stage(tmp_path, tiny_tokenizer):
    loader = StageLoader(saved(tmp_path / "model", True, tiny_tokenizer), dtype="float32")
    assert loader.layers() == 4
    assert len(loader().decoder.layers) == 4
    assert loader.stage([3, 1], 1, "cpu").layers == 1


def test_a_stage_that_would_not_fit_its_gpu_is_refused_before_anything_is_allocated(tmp_path, tiny_tokenizer,
                                                                                     monkeypatch):
    """The stage's size is counted on `meta` (nothing loaded yet) and checked against the device's free memory
    first: a CUDA device reporting 1 KiB free refuses the stage naming it and the numbers, with no CUDA call
    beyond the free-memory query (this machine has no GPU: the query is stubbed)."""
    from actors.engine.pipeline import stage_loading, stage_model
    folder = saved(tmp_path / "model", False, tiny_tokenizer)
    whole = load_base_model(folder, dtype="float32", device="cpu")
    layer = whole.decoder.layers[0]
    on_meta = copy.deepcopy(layer).to("meta")
    assert stage_model.stage_bytes([on_meta]) == sum(p.numel() * 4 for p in layer.parameters()) > 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1024, 1024))
    monkeypatch.setattr(stage_loading, "resolve_device", lambda device: torch.device("cuda:0"))
    with pytest.raises(MemoryError, match=r"pipeline stage 1: its weights need 0\.00 GiB and cuda:0 has 0\.00 GiB "
                                          r"free; cut the base into more stages"):
        load_stage(folder, [2, 2], 1, device="cuda:0", dtype="float32")


def test_a_moe_base_is_not_split_into_stages(tmp_path, tiny_tokenizer):
    """An MoE checkpoint keeps each expert's weights apart (transformers stacks them as the whole model loads), so
    a stage, which reads its own tensors by name, refuses it before reading any, saying to train on one device."""
    from tests.helpers.model_families import build_config, build_model

    folder = tmp_path / "moe"
    build_model(build_config("qwen3_moe", vocab_size=VOCAB, num_hidden_layers=4)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"is an MoE model \(qwen3_moe\).*train it on one device"):
        load_stage(str(folder), [2, 2], 0, device="cpu")
    assert load_base_model(str(folder), device="cpu").model.config.model_type == "qwen3_moe"   # whole, it loads


def test_a_base_of_a_type_not_cut_into_stages_is_refused_before_its_layers_are_read(tmp_path, tiny_tokenizer):
    """GPT-2 (its final norm is `ln_f`, its positions an embedding of their own) and a Qwen3.5 checkpoint (a
    vision-language model's text model) load whole, but a stage refuses them, saying to train on one device."""
    from tests.helpers.model_families import build_config, build_model

    folder = tmp_path / "gpt2"
    build_model(build_config("gpt2", vocab_size=VOCAB, num_hidden_layers=4)).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"\(model_type 'gpt2'\) cannot be cut into pipeline stages yet.*stages: 1"):
        load_stage(str(folder), [2, 2], 0, device="cpu")
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = build_config("qwen3_5_text", vocab_size=VOCAB, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention"] * 2).to_dict()
    folder = tmp_path / "qwen3_5"
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config={
        "depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64})
    ).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"qwen3_5 checkpoint whose text model is stored inside.*no `stages`"):
        load_stage(str(folder), [2, 2], 0, device="cpu")
