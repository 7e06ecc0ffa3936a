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
