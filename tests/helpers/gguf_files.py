"""Tiny GGUF files written by gguf-py's own writer, and transformers' converter's names for a model class's weights
(the reference the GGUF header's names are checked against: tests/unit/engine/test_gguf_header.py)."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers.model_families import build_config


def converter_names(arch: str, model_type: str) -> tuple[dict[str, str], set[str], dict[str, int]]:
    """transformers' GGUF -> HF names of the model type's weights (its converter on the model class, with the GGUF
    architecture's tensor processor), its linear layers LoRA may adapt (as a trainer lays the model out: GPT-2's
    Conv1D as linear layers), and each GGUF weight's number of dimensions (the HF parameter's; a short convolution's
    3-D kernel written 2-D, as llama.cpp writes it)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from actors.engine.adapter_surgery import linear_module_names
    from actors.engine.conv1d_layers import conv1d_as_linear

    config = build_config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    table = {g.removesuffix(".weight"): h.removesuffix(".weight")
             for g, h in get_gguf_hf_weights_map(model, processor).items() if g.endswith(".weight")}
    params = dict(model.named_parameters())
    dims = {g: params[h + ".weight"].dim() for g, h in table.items() if h + ".weight" in params}
    dims = {g: 2 if d == 3 and not g.endswith("_exps") else d for g, d in dims.items()}
    conv1d_as_linear(model)
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


def write_loadable_gguf(path, arch: str, config) -> None:
    """A GGUF file transformers loads (`from_pretrained(..., gguf_file=...)`): the config's fields under the GGUF keys
    transformers reads back (GGUF_CONFIG_MAPPING), a vocabulary, and each weight its converter names for the model
    class built from `config`, zeros of the parameter's shape."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    params = dict(model.named_parameters())
    writer = gguf.GGUFWriter(str(path), arch)
    fields = config.to_dict()
    rope_theta = float((fields.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    for key, name in GGUF_CONFIG_MAPPING[arch if arch in GGUF_CONFIG_MAPPING else config.model_type].items():
        value = fields.get(name) if name else None
        value = config.num_hidden_layers if key == "block_count" else value
        value = 1e-5 if value is None and "epsilon" in key else value
        value = rope_theta if value is None and key == "rope.freq_base" else value
        if arch == "lfm2" and key == "attention.head_count_kv":   # llama.cpp says which layers attend this way
            writer.add_array(f"{arch}.{key}", [value if kind == "full_attention" else 0 for kind in config.layer_types])
        elif isinstance(value, int) and not isinstance(value, bool):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
    writer.add_token_list([f"token{i}" for i in range(config.vocab_size)])
    writer.add_pad_token_id(0)
    for name, hf_name in get_gguf_hf_weights_map(model, processor).items():
        if hf_name in params:
            writer.add_tensor(name, np.zeros(tuple(params[hf_name].shape), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
