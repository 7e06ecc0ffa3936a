"""The engine's own paths for the verified models' special features (actors/engine/loss.py, attention.py), each
against its own reference: the chunked loss under each logit transform (Gemma's soft-cap, Granite's divide,
Cohere's multiply) against autograd through the transform written out, and the per-sequence attention with
soft-capping (Gemma 2) and sinks (gpt-oss) against the model's own eager attention (on CUDA too, in bfloat16)."""

from __future__ import annotations

import importlib

import pytest
import torch

from actors.engine.attention import varlen_attention_forward
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.model_support import LogitTransform
from tests.helpers.model_families import WINDOW, relative


@pytest.mark.parametrize("transform", [LogitTransform(softcap=1.5), LogitTransform(divide=4.0),
                                       LogitTransform(multiply=3.0)], ids=["softcap", "divide", "multiply"])
def test_chunked_loss_with_a_logit_transform_equals_autograd(transform):
    """The loss computes its gradient in the forward pass, chunk by chunk: against autograd through the
    transform written out (Gemma's cap * tanh(raw / cap), Granite's raw / s, Cohere's raw * s)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=generator, dtype=torch.float64) * 3
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    bias = torch.randn(40, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 40, (11,), generator=generator)
    token_weights = torch.rand(11, generator=generator, dtype=torch.float64)

    reference_hidden = hidden.clone().requires_grad_(True)
    logits = (reference_hidden @ weight.T + bias) * transform.multiply / transform.divide
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    (per_token * token_weights).sum().backward()

    engine_hidden = hidden.float().requires_grad_(True)
    total, losses = target_cross_entropy(engine_hidden, weight.float(), bias.float(), targets, token_weights.float(),
                                         chunk=3, transform=transform)
    total.backward()
    # the engine's logits are float32, the reference's float64: 1e-5 relative (norm of the difference)
    assert relative(losses.double(), per_token.detach()) <= 1e-5
    assert relative(engine_hidden.grad.double(), reference_hidden.grad) <= 1e-5


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_softcap_and_sink_attention_equals_the_models_eager_attention(model_type, device):
    """The per-sequence path for soft-capping (Gemma 2) and sinks (gpt-oss) against the model's own eager
    attention run on each sequence with its causal sliding-window mask. On CUDA in bfloat16 this is also
    the path taken instead of the varlen kernels, which lack both features."""
    eager = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}").eager_attention_forward
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 17, 30]
    layout = StepLayout.single("x", lengths)

    def tensor(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, layout.num_tokens, 16, generator=generator).to(device, dtype)

    query, key, value = tensor(4), tensor(2), tensor(2)
    module = torch.nn.Module().to(device)
    module.num_key_value_groups = 2
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=generator).to(device, dtype), requires_grad=False)
    module.eval()
    features = {"softcap": 0.7} if model_type == "gemma2" else {"s_aux": module.sinks}
    with step_layout(layout):
        ours, _ = varlen_attention_forward(module, query, key, value, None, scaling=0.5, sliding_window=WINDOW,
                                           **features)
    expected = []
    for start, end in layout.sequences:
        index = torch.arange(end - start, device=device)
        distance = index[:, None] - index[None, :]
        allowed = (distance >= 0) & (distance < WINDOW)
        mask = torch.zeros(end - start, end - start, device=device, dtype=dtype)
        mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        extra = {"softcap": 0.7} if model_type == "gemma2" else {}
        out, _ = eager(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], mask,
                       scaling=0.5, dropout=0.0, **extra)
        expected.append(out)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), torch.cat(expected, dim=1).float(), rtol=tolerance, atol=tolerance)
