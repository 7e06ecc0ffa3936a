"""A GGUF file's linear layers read from its header (actors/storage/gguf_header.py) are named as transformers'
converter names them: for each architecture it maps, the converter's own table (`get_gguf_hf_weights_map`, GGUF name
-> Hugging Face name, built from the model class on `meta`) read the other way gives every linear layer's name; an
architecture it does not map answers None (its layers are checked by its trainer, as before). The header of a file
written by gguf-py's own writer is read as gguf-py's reader reads it. (Against the real smollm2-135m file and its
converted model: tests/slow/test_smollm2.py.)"""

from __future__ import annotations

import pytest
import torch

from actors.storage import gguf_header
from tests.helpers.gguf_files import converter_names, write_gguf, write_loadable_gguf
from tests.helpers.model_families import build_config


@pytest.mark.parametrize("arch", gguf_header.MAPPED_ARCHITECTURES)
def test_the_header_names_are_the_converters(tmp_path, arch):
    """A GGUF file holding every weight transformers' converter names for the model class (its routers, embeddings,
    expert stacks and norms too) gives exactly the class's linear layers, named as the converter names them."""
    model_type = gguf_header.ARCHITECTURES[arch].model_type
    table, linear, dims = converter_names(arch, model_type)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, build_config(model_type).num_hidden_layers, dims)
    found_type, names = gguf_header.hf_linear_names(path)
    assert found_type == model_type
    assert sorted(names) == sorted(linear), set(names) ^ linear
    assert {table[g] for g in dims if table[g] in linear} == linear   # each linear layer came from a GGUF tensor


@pytest.mark.parametrize("arch", gguf_header.MAPPED_ARCHITECTURES)
def test_the_header_names_are_those_of_the_model_transformers_loads_from_the_file(tmp_path, arch):
    """The reference is transformers' own GGUF loading: the model `from_pretrained(..., gguf_file=...)` builds from
    the file's keys and weights, laid out as a trainer lays it out, has exactly the linear layers the header names.
    (Gemma 4's file is written without shared keys and values and without keys as values: transformers' GGUF loading
    reads neither field, so it would build projections such a file does not hold.)"""
    from transformers import AutoModelForCausalLM

    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.conv1d_layers import conv1d_as_linear

    model_type = gguf_header.ARCHITECTURES[arch].model_type
    plain = {"num_kv_shared_layers": 0, "attention_k_eq_v": False} if model_type == "gemma4_text" else {}
    write_loadable_gguf(tmp_path / "base.gguf", arch, build_config(model_type, **plain))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="base.gguf", dtype=torch.float32,
                                                  ignore_mismatched_sizes=True)   # (shapes: GGUF keys it lacks)
    conv1d_as_linear(loaded)
    found_type, names = gguf_header.hf_linear_names(tmp_path / "base.gguf")
    assert found_type == loaded.config.model_type
    assert sorted(names) == sorted(linear_module_names(loaded))


def test_every_gguf_architecture_aspen_trains_is_mapped():
    """Each architecture transformers converts from GGUF whose model type aspen trains (actors/engine/model_support.py)
    is one the header maps: the others, refused at submit, are ones no trainer could train."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from actors.engine.model_support import SUPPORTED

    mapped = {arch.model_type for arch in gguf_header.ARCHITECTURES.values()}
    # transformers' names for the converted model types; its `mistral` is a Llama file named so (the same layers)
    as_model_type = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "mistral": "llama"}
    trainable = {as_model_type.get(name, name) for name in GGUF_SUPPORTED_ARCHITECTURES} & set(SUPPORTED)
    assert trainable - mapped == set()
    assert mapped <= set(SUPPORTED)


def test_the_header_is_read_as_gguf_py_reads_it(tmp_path):
    import gguf

    path = tmp_path / "some.gguf"
    write_gguf(path, "llama", 3, {"token_embd": 2, "blk.0.attn_q": 2, "blk.0.attn_norm": 1, "blk.2.ffn_up": 2})
    header = gguf_header.read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.architecture == reader.fields["general.architecture"].contents() == "llama"
    assert header.block_count == reader.fields["llama.block_count"].contents() == 3
    assert header.tensors == {t.name.removesuffix(".weight"): len(t.shape) for t in reader.tensors}


def test_an_architecture_aspen_does_not_train_a_tensor_it_does_not_know_and_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "bloom.gguf"
    write_gguf(path, "bloom", 2, {"blk.0.attn_qkv": 2})
    with pytest.raises(gguf_header.UnsupportedArchitecture, match=r"architecture 'bloom'.*: llama, qwen2, .*phi3"):
        gguf_header.hf_linear_names(path)   # transformers converts it; aspen trains no bloom model
    path = tmp_path / "phi3.gguf"
    write_gguf(path, "phi3", 2, {"blk.0.attn_qkv": 2, "blk.0.attn_new_thing": 2})
    assert gguf_header.hf_linear_names(path) is None   # a variant the table does not know: left to its trainer
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_header.read_header(tmp_path / "not.gguf")
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="cut short"):
        gguf_header.read_header(tmp_path / "short.gguf")
