"""What the model-support contract (actors/engine/model_support.py) refuses, each refusal with its reason: model
types and features outside the verified table refused at load, from the config alone (remote-code checkpoints
such as ChatGLM naming the native GLM-4 types); why dynamic RoPE is refused (a packed neighbour changes a
sequence's logits); the packed attention refusing an argument it does not implement; docs/models.md's table
is the code's table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.data import Example
from actors.engine.attention import use_varlen_attention, varlen_attention_forward
from actors.engine.layout import StepLayout, step_layout
from actors.engine.model_support import UnsupportedModelError, check_model_support, markdown_table
from actors.engine.models import from_module, load_base_model
from tests.helpers.model_families import build_config, build_model, examples, relative

REPO = Path(__file__).resolve().parents[3]

REFUSED = [
    ("bloom", {}, r"model_type 'bloom'\) is not in aspen's verified table .*: llama, mistral, qwen2"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     r"rope type 'dynamic'.*packed row's longest sequence.*refused"),
    # an alpha makes 'dynamic' static on HunYuan's types only (their own code), and only with the alpha
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}},
     r"rope type 'dynamic'.*packed row's longest sequence.*refused"),
    ("hunyuan_v1_dense", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     r"rope type 'dynamic'.*packed row's longest sequence.*refused"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 64, "rope_theta": 10000.0},
              "original_max_position_embeddings": 64},
     r"rope type 'longrope'.*short and long factors.*refused"),
    ("gemma3_text", {"use_bidirectional_attention": True}, r"use_bidirectional_attention=True.*refused"),
    ("gemma4_text", {"use_bidirectional_attention": "all"}, r"use_bidirectional_attention='all'.*refused"),
    ("gemma4_text", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
     r"enable_moe_block=True.*refused; use a dense Gemma 4 model"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}},
     r"its checkpoint is quantized \(gptq\).*refused; use the model's float \(bf16\) checkpoint"),
    ("llama", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quantized \(fp8\).*set \"dequantize\": true"),
    ("gpt_oss", {"output_router_logits": True}, r"output_router_logits=True.*load-balancing loss.*refused"),
    ("falcon", {"alibi": True, "parallel_attn": False, "bias": True}, r"alibi=True.*refused; use a rotary Falcon"),
    ("gpt2", {"add_cross_attention": True}, r"add_cross_attention=True.*refused; use a decoder-only GPT-2"),
    ("mixtral", {"output_router_logits": True}, r"output_router_logits=True.*load-balancing loss.*refused"),
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8},
     r"use_sliding_window=True.*mask only, not to the attention kernel.*refused"),
]


@pytest.mark.parametrize("model_type, fields, message", REFUSED)
def test_refused_at_load_with_its_reason(model_type, fields, message, tmp_path):
    config = build_config(model_type, **fields)
    with pytest.raises(UnsupportedModelError, match=message):
        from_module(build_model(config), None)
    # load_base_model refuses from the config alone, before any weight is read (the folder has none)
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=message):
        load_base_model(str(tmp_path), device="cpu")


CHATGLM_CONFIG = {"model_type": "chatglm", "architectures": ["ChatGLMModel"],
                  "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig",
                               "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration"},
                  "num_layers": 2, "hidden_size": 64, "padded_vocab_size": 128, "multi_query_attention": True,
                  "multi_query_group_num": 2, "kv_channels": 16, "ffn_hidden_size": 96}


def test_remote_code_chatglm_is_refused_naming_native_glm4(tmp_path):
    """The remote-code ChatGLM2/3 (its config.json names model_type 'chatglm' and its own Python classes):
    transformers cannot even read its config without trust_remote_code; aspen refuses it before anything is
    run, naming the transformers-native GLM-4 model types to use instead."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(CHATGLM_CONFIG))
    message = r"model_type 'chatglm'.*trust_remote_code.*refused; use a transformers-native GLM-4.*'glm' or 'glm4'"
    with pytest.raises(UnsupportedModelError, match=message):
        load_base_model(str(tmp_path), device="cpu")
    # another remote-code type aspen does not know: refused for its auto_map, naming the verified types
    (tmp_path / "config.json").write_text(json.dumps({**CHATGLM_CONFIG, "model_type": "internlm2"}))
    with pytest.raises(UnsupportedModelError, match=r"'internlm2'\) needs its own modeling code .*auto_map.*glm4"):
        load_base_model(str(tmp_path), device="cpu")
    # a config object of that type (e.g. built by remote code elsewhere) is refused the same way
    with pytest.raises(UnsupportedModelError, match=message):
        check_model_support(type("ChatGLMConfig", (), {"model_type": "chatglm"})())


def test_dynamic_rope_would_make_a_job_depend_on_its_neighbours():
    """Why dynamic NTK is refused: transformers rescales by the longest position of the whole forward,
    so the same sequence gets another loss when a long one is packed beside it."""
    model = build_model(build_config("llama", max_position_embeddings=16,
                                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10.0}))
    use_varlen_attention(model)
    short, long = examples(0, [12])[0], examples(1, [40])[0]

    def first_sequence_logits(sequences: list[Example]) -> torch.Tensor:
        ids = torch.tensor([[t for e in sequences for t in e.input_ids]])
        positions = torch.cat([torch.arange(len(e)) for e in sequences])[None]
        with torch.no_grad(), step_layout(StepLayout.single("none", [len(e) for e in sequences])):
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, :len(short)]

    alone, packed = first_sequence_logits([short]), first_sequence_logits([short, long])
    assert relative(packed, alone) > 1e-3


def test_attention_refuses_an_argument_it_does_not_implement():
    class Bidirectional(torch.nn.Module):
        is_causal = False

    query = torch.randn(1, 2, 6, 8)
    with step_layout(StepLayout.single("x", [6])):
        with pytest.raises(NotImplementedError, match="Bidirectional passes is_causal=False"):
            varlen_attention_forward(Bidirectional(), query, query, query, None)
        with pytest.raises(NotImplementedError, match="passes chunk_size"):
            varlen_attention_forward(torch.nn.Module(), query, query, query, None, chunk_size=4)


def test_readme_table_is_the_code_table():
    page = (REPO / "docs" / "models.md").read_text()
    assert "# Supported models" in page
    assert markdown_table() in page, "docs/models.md's table differs from model_support.markdown_table(): paste it"
