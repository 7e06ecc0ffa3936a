"""Loading a quantized base: memory at the loading peak (measured by the process, against the previous way
of loading), the two ways of quantizing (transformers' on-the-fly for folders, linear by linear for GGUF)
giving the same layers, LoRA gradients through NF4 layers against a float model, and the GGUF base."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from actors.engine.adapter_surgery import add_adapter
from actors.engine.layout import StepLayout, step_layout
from actors.engine.models import from_module, load_model, quantize_linears
from actors.spec.lora_config import LoraConfig
from actors.storage.sources import resolve_source
from tests.helpers.models import REPO, tiny_model

bnb = pytest.importorskip("bitsandbytes")

SLACK = 4 * 2**20   # the interpreter's own allocations while loading (module objects, loader state), 4 MiB


@pytest.fixture(scope="module")
def float32_folder(tmp_path_factory):
    """A random Llama whose decoder layers dominate its size (8 layers of 7.9 MB in bfloat16, 0.6 MB of
    embeddings and head), saved in float32: loaded in bfloat16 (CUDA's default dtype), a float model on the
    CPU is then memory of its own, not a view of the mapped checkpoint file."""
    config = LlamaConfig(vocab_size=300, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("float32-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    layer = sum(p.numel() for p in LlamaForCausalLM(config).model.layers[0].parameters()) * 4
    return folder, layer


def probe(folder, way: str, quantization: str) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run([sys.executable, "-m", "tests.helpers.load_peak_probe", str(folder), way, quantization],
                            cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_loading_peak_is_the_quantized_model_plus_one_layer(float32_folder, quantization):
    """Peak memory while loading a quantized base <= its quantized size + one decoder layer in float32 (the
    checkpoint's dtype: one tensor at a time is read, cast and quantized) + 4 MiB. The previous way (the
    whole float model first, then quantized) peaks above that bound, so the bound tells them apart.
    Measured (int8 / nf4): quantized 32.3 / 16.9 MB; loading peak 43.1 / 32.5 MB (bound 51.9 / 36.5 MB);
    the previous way 104.9 / 94.4 MB. tests/helpers/load_peak_probe.py says how the peak is counted."""
    folder, layer_bytes = float32_folder
    new = probe(folder, "new", quantization)
    bound = new["model_bytes"] + layer_bytes + SLACK
    assert new["peak_bytes"] <= bound, (new, bound)
    old = probe(folder, "old", quantization)
    assert old["model_bytes"] == new["model_bytes"]
    assert old["peak_bytes"] > bound, (old, bound)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_linear_by_linear_quantization_equals_transformers_on_the_fly(tiny_model_dirs, quantization):
    """The GGUF path (quantize_linears on a loaded float model) gives the layers transformers' on-the-fly
    quantization (the folder path) gives: same types, same quantized bytes and scales, the LM head and the
    embeddings left in float."""
    folder = tiny_model_dirs["llama"]
    on_the_fly = load_model(resolve_source(str(folder)), torch.float32, torch.device("cpu"), quantization)
    after = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    quantize_linears(after, quantization, torch.float32, torch.device("cpu"))
    kind = bnb.nn.Linear8bitLt if quantization == "int8" else bnb.nn.Linear4bit
    compared = 0
    for (name, a), (_, b) in zip(on_the_fly.named_modules(), after.named_modules(), strict=True):
        if not isinstance(a, torch.nn.Linear):
            continue
        if a is on_the_fly.get_output_embeddings():
            assert type(a) is torch.nn.Linear and type(b) is torch.nn.Linear
            assert torch.equal(a.weight, b.weight)
            continue
        assert isinstance(a, kind) and isinstance(b, kind), name
        assert torch.equal(a.weight.data, b.weight.data), name
        if quantization == "int8":
            assert torch.equal(a.weight.SCB, b.weight.SCB) and a.state.threshold == b.state.threshold == 0.0
        else:
            assert torch.equal(bnb.functional.dequantize_4bit(a.weight.data, a.weight.quant_state),
                               bnb.functional.dequantize_4bit(b.weight.data, b.weight.quant_state)), name
        compared += 1
    assert compared == 2 * 7   # every projection of both decoder layers
    assert type(on_the_fly.get_input_embeddings()) is torch.nn.Embedding


def _adapter_gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    base = from_module(model, None)
    handle = add_adapter(base.model, "job", LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    for layer in handle.layers.values():
        torch.nn.init.normal_(layer.lora_B, std=0.02, generator=torch.Generator().manual_seed(1))
    layout = StepLayout.single("job", [ids.shape[0]])
    with step_layout(layout):
        for _ in range(2):   # the second step too: bitsandbytes changed layers after their first call
            for parameter in handle.parameters():
                parameter.grad = None
            hidden = base.decoder(input_ids=ids[None], position_ids=torch.arange(ids.shape[0])[None],
                                  use_cache=False).last_hidden_state
            base.lm_head(hidden).float().logsumexp(-1).sum().backward()
    return {name: parameter.grad.clone() for name, parameter in handle.named_parameters()}


def test_lora_gradients_through_nf4_layers_equal_those_of_the_dequantized_float_model():
    """The reference: the same model with each NF4 layer replaced by a float nn.Linear holding the NF4
    weight dequantized. The adapters' gradients agree (float32 rounding of two matmul kernels), including
    those of the first layer, whose gradient flows back through every NF4 layer above it: bitsandbytes'
    CPU inference repacking would cut that flow (actors/engine/models.py keeps it off)."""
    quantized = tiny_model("llama", 300)
    quantize_linears(quantized, "nf4", torch.float32, torch.device("cpu"))
    reference = tiny_model("llama", 300)
    for name, module in list(quantized.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            reference.get_submodule(name).weight.data = weight.float()
    ids = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(0))
    got, expected = _adapter_gradients(quantized, ids), _adapter_gradients(reference, ids)
    assert got.keys() == expected.keys()
    first_layer = [k for k in expected if ".layers.0." in k]
    assert all(float(expected[k].abs().max()) > 0 for k in first_layer)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-7, msg=key)


def test_gguf_base_loads_quantized_with_head_and_embeddings_in_float():
    from actors.engine.models import load_base_model

    base = load_base_model("smollm2-135m", device="cpu", quantization="nf4")
    linears = [m for m in base.model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in linears if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 30 * 7 and len(linears) == len(quantized) + 1
    assert type(base.lm_head) is torch.nn.Linear and base.lm_head.weight.dtype == torch.float32
    ids = base.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = base.model(input_ids=ids, use_cache=False).logits
    assert base.tokenizer.decode(logits[0, -1].argmax()).strip() == "Paris"
