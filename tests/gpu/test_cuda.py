"""The CUDA paths against their CPU-tested references, where a GPU is present (skipped elsewhere: CI has
none; run on a GPU machine with `pytest tests/gpu/test_cuda.py`): the varlen flash-attention kernel against
per-sequence sdpa, and the float32 path's grouped LoRA against per-segment LoRA."""

from __future__ import annotations

import pytest
import torch

from actors.engine import attention, lora_grouped
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(attention.torch_varlen_attn is None and not attention.HAS_FLASH_ATTN,
                    reason="no varlen kernel (torch < 2.10 and no flash-attn)")
@pytest.mark.parametrize("kv_heads", [9, 3])
def test_varlen_kernel_equals_per_sequence_sdpa_forward_and_backward(monkeypatch, kv_heads):
    layout = StepLayout.single("x", [37, 80, 5, 128, 64])
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, layout.num_tokens, 64, device="cuda", dtype=torch.bfloat16, generator=generator)

    q, k, v = tensor(9), tensor(kv_heads), tensor(kv_heads)
    results = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setattr(attention, "torch_varlen_attn", None)
            monkeypatch.setattr(attention, "HAS_FLASH_ATTN", False)
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        with step_layout(layout):
            out, _ = attention.varlen_attention_forward(None, *inputs, None, scaling=0.125)
        out.float().square().sum().backward()
        results.append([out.float(), *(t.grad.float() for t in inputs)])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_grouped_lora_is_the_float32_paths_default_on_cuda_and_equals_per_segment(monkeypatch):
    """The float32 path's grouped way (a float16 base's on CUDA; bfloat16 and float32 take the CUDA LoRA path:
    tests/gpu/test_cuda_fast_path.py)."""
    from actors.engine import lora_cuda

    monkeypatch.setattr(lora_cuda, "COMPUTE", "float32")
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 48).cuda().to(torch.bfloat16).requires_grad_(False)
    layer = FusedLoraLinear(base)
    for index, rank in enumerate((4, 8, 2)):
        adapter = LoraAdapter(64, 48, LoraConfig(r=rank, alpha=16), generator=torch.Generator().manual_seed(index),
                              device=torch.device("cuda"))
        torch.nn.init.normal_(adapter.lora_B)
        layer.adapters[f"job{index}"] = adapter
    layout = StepLayout((("job0", 0, 30), ("job1", 30, 70), ("job2", 70, 100)), ((0, 30), (30, 70), (70, 100)), 100)
    x = torch.randn(1, 100, 64, device="cuda", dtype=torch.bfloat16)
    calls = []
    original = lora_grouped.grouped_delta

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(lora_grouped, "grouped_delta", counting)
    results = []
    for mode in ("auto", "segments"):
        monkeypatch.setattr(lora_grouped, "GROUPING", mode)
        for adapter in layer.adapters.values():
            adapter.lora_A.grad = adapter.lora_B.grad = None
        with step_layout(layout):
            out = layer(x)
        out.float().square().sum().backward()
        results.append([out.float(), *(a.lora_A.grad.clone() for a in layer.adapters.values()),
                        *(a.lora_B.grad.clone() for a in layer.adapters.values())])
    assert calls, "auto did not take the grouped way on CUDA"
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_quantized_base_loads_within_its_quantized_size_plus_one_layer_of_gpu_memory(tmp_path, quantization):
    """On the GPU, with its allocator's own peak counter: loading a quantized base (bfloat16, from a float32
    folder) peaks at most one float32 decoder layer + 4 MiB above the quantized model; the previous way
    (the float model moved to the GPU, then quantized) peaks above that bound."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from actors.engine.models import load_model, quantize_linears
    from actors.storage.sources import resolve_source
    from tests.helpers.load_peak_probe import tensor_bytes

    config = LlamaConfig(vocab_size=300, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    layer_bytes = sum(p.numel() for p in LlamaForCausalLM(config).model.layers[0].parameters()) * 4
    device = torch.device("cuda")

    def peak(load) -> tuple[int, int]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = load()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, tensor_bytes(model)

    new_peak, model_bytes = peak(lambda: load_model(resolve_source(str(tmp_path)), torch.bfloat16, device,
                                                    quantization))
    bound = model_bytes + layer_bytes + 4 * 2**20
    assert new_peak <= bound, (new_peak, bound)

    def old_way():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to(device)
        quantize_linears(model, quantization, torch.bfloat16, device)
        return model

    old_peak, _ = peak(old_way)
    assert old_peak > bound, (old_peak, bound)


def test_the_cuda_count_without_torch_is_torchs_where_there_is_a_gpu():
    """`aspen run --device auto`'s GPU check without torch (the CUDA driver's count) where it counts devices."""
    from tests.helpers.cuda_count import assert_cuda_count_is_torchs

    assert_cuda_count_is_torchs()
