"""A GGUF file's linear layers read from its header (actors/storage/gguf_header.py) are named as transformers'
converter names them: for each architecture it maps, the converter's own table (`get_gguf_hf_weights_map`, GGUF name
-> Hugging Face name, built from the model class on `meta`) read the other way gives every linear layer's name; an
architecture it does not map answers None (its layers are checked by its trainer, as before). The header of a file
written by gguf-py's own writer is read as gguf-py's reader reads it. (Against the real smollm2-135m file and its
converted model: tests/slow/test_smollm2.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.storage import gguf_header
from tests.helpers.model_families import build_config


def converter_names(model_type: str) -> tuple[dict[str, str], set[str], dict[str, int]]:
    """transformers' GGUF -> HF names of the model type's weights, its linear layers LoRA may adapt, and each GGUF
    weight's number of dimensions (the HF parameter's)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from actors.engine.adapter_surgery import linear_module_names

    config = build_config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(model_type, TensorProcessor)(config=config.to_dict())
    table = {g.removesuffix(".weight"): h.removesuffix(".weight")
             for g, h in get_gguf_hf_weights_map(model, processor).items() if g.endswith(".weight")}
    params = dict(model.named_parameters())
    dims = {g: params[h + ".weight"].dim() for g, h in table.items() if h + ".weight" in params}
    return table, set(linear_module_names(model)), dims


def write_gguf(path, arch: str, blocks: int, tensors: dict[str, int]) -> None:
    """A GGUF file by gguf-py's writer: the architecture, its block count, a vocabulary to skip, and each tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(blocks)
    writer.add_token_list([f"token{i}" for i in range(300)])
    writer.add_array("some.floats", [0.5] * 7)
    for name, dims in tensors.items():
        writer.add_tensor(name + ".weight", np.zeros((4,) * dims, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", gguf_header.MAPPED_ARCHITECTURES)
def test_the_header_names_are_the_converters(tmp_path, arch):
    table, linear, dims = converter_names(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, build_config(arch).num_hidden_layers, dims)
    model_type, names = gguf_header.hf_linear_names(path)
    assert model_type == arch
    assert sorted(names) == sorted(linear), set(names) ^ linear


def test_the_header_is_read_as_gguf_py_reads_it(tmp_path):
    import gguf

    path = tmp_path / "some.gguf"
    write_gguf(path, "llama", 3, {"token_embd": 2, "blk.0.attn_q": 2, "blk.0.attn_norm": 1, "blk.2.ffn_up": 2})
    header = gguf_header.read_header(path)
    reader = gguf.GGUFReader(str(path))
    assert header.architecture == reader.fields["general.architecture"].contents() == "llama"
    assert header.block_count == reader.fields["llama.block_count"].contents() == 3
    assert header.tensors == {t.name.removesuffix(".weight"): len(t.shape) for t in reader.tensors}


def test_an_architecture_it_does_not_map_and_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "phi3.gguf"
    write_gguf(path, "phi3", 2, {"blk.0.attn_qkv": 2})
    assert gguf_header.hf_linear_names(path) is None   # phi3's qkv_proj is not the table's first name
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_header.read_header(tmp_path / "not.gguf")
    (tmp_path / "short.gguf").write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="cut short"):
        gguf_header.read_header(tmp_path / "short.gguf")
