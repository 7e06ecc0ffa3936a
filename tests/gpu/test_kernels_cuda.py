"""The base's fused GPU work against references, where a CUDA GPU is present (skipped elsewhere: CI has none; on a
GPU machine `pytest tests/gpu/test_kernels_cuda.py`):

- torch's varlen flash-attention kernel given grouped-query key/value heads as they are (actors/engine/attention.py,
  `VARLEN_GQA`: "native" on torch 2.10 / 2.11, the `enable_gqa` flag from 2.12), its output and gradients against
  per-sequence sdpa with `enable_gqa` in float32 on the same bfloat16 inputs;
- where Liger-Kernel is installed (the `gpu` extra), its kernels as `kernels: liger` swaps them in, in bfloat16:
  each alone and all four on a tiny Llama and Qwen3 against the same model without them, `auto` choosing them,
  and the fused loss against float64.

Bounds. bfloat16's unit roundoff u = 2^-8 / 2 = 2^-9; the products and sums inside the kernels run in float32, so
what separates two bfloat16 computations is the roundings of their intermediate results to bfloat16, counted
along the longest chain (tests/helpers/tolerances.py's model: independent roundings, 6 standard deviations of
their random walk, never more than the worst case). Flash attention rounds the probabilities P before P·V and its
output (forward), dS, P and its outputs (backward): at most 8 roundings per value, each relative to the sum of the
absolute terms of the value's sum (Higham's |A||B|), computed here from the float32 reference. The model's chain
(`bf16_roundings`) counts the bfloat16 results a token's value passes through per layer. The semantics of Liger's
kernels (casting mode, RoPE's convention, the loss's transform and weights) are checked tightly in float32 on a CPU
(tests/unit/engine/test_kernels_interpreted.py); these bounds catch what only bfloat16 on a GPU could break."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from actors.engine import attention, kernels
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy, use_fused_loss
from actors.engine.model_support import LogitTransform
from actors.engine.models import from_module
from tests.helpers.kernels import SPIED, VOCAB, forwards_rebound, fused_step, spy_on_liger, tiny
from tests.helpers.tolerances import rounding_tolerance, unit_roundoff
from tests.helpers.triton_interpreter import liger_installed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_liger = pytest.mark.skipif(not liger_installed(), reason="Liger-Kernel is not installed (the gpu extra)")

BF16 = torch.bfloat16
U = unit_roundoff(BF16)
ATTENTION_ROUNDINGS = 8


# -- grouped-query attention through torch's varlen kernel --------------------------------------------------------

def _reference_attention(q, k, v, grad_out, lengths, scale, window):
    """Per sequence, sdpa with enable_gqa in float32 (output and gradients), and the sums of absolute terms of each
    output's and gradient's entries (from P and dS computed by hand, the key/value heads repeated)."""
    groups = q.shape[1] // k.shape[1]
    outs, grads, terms = [], [[], [], []], {"out": 0.0, "q": 0.0, "k": 0.0, "v": 0.0}
    start = 0
    for length in lengths:
        piece = [t[:, :, start:start + length].float().detach().requires_grad_(True) for t in (q, k, v)]
        i = torch.arange(length, device=q.device)
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or length + 1))
        out = F.scaled_dot_product_attention(*piece, attn_mask=allowed, scale=scale, enable_gqa=groups > 1)
        g = grad_out[:, :, start:start + length].float()
        out.backward(g)
        outs.append(out.detach())
        for index, tensor in enumerate(piece):
            grads[index].append(tensor.grad)
        with torch.no_grad():
            qf, kf, vf = piece[0], *(t.repeat_interleave(groups, dim=1) for t in piece[1:])
            scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
            p = torch.softmax(scores, dim=-1)
            d_p = g @ vf.transpose(-1, -2)
            d_s = p * (d_p - (g * out).sum(-1, keepdim=True))
            grouped = lambda t: t.unflatten(1, (-1, groups)).sum(2)   # noqa: E731 - kv heads' sums over their group
            terms["out"] = max(terms["out"], float((p @ vf.abs()).max()))
            terms["v"] = max(terms["v"], float(grouped(p.transpose(-1, -2) @ g.abs()).max()))
            terms["q"] = max(terms["q"], float((d_s.abs() @ kf.abs()).max()) * scale)
            terms["k"] = max(terms["k"], float(grouped(d_s.abs().transpose(-1, -2) @ qf.abs()).max()) * scale)
        start += length
    cat = lambda parts: torch.cat(parts, dim=2)   # noqa: E731
    return cat(outs), [cat(parts) for parts in grads], terms


@pytest.mark.skipif(attention.torch_varlen_attn is None, reason="torch < 2.10: no varlen_attn")
@pytest.mark.parametrize("window", [None, 24])
def test_the_varlen_kernel_takes_grouped_heads_unrepeated(monkeypatch, window):
    heads, kv_heads, dim, scale = 16, 4, 64, 0.125
    lengths = [37, 80, 5, 128, 64]
    layout = StepLayout.single("x", lengths)
    seen = []
    kernel = attention.torch_varlen_attn

    def recording(query, key, value, *args, **kwargs):
        seen.append(key.shape[1])
        return kernel(query, key, value, *args, **kwargs)

    monkeypatch.setattr(attention, "torch_varlen_attn", recording)
    generator = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, h, layout.num_tokens, dim, device="cuda", dtype=BF16,  # noqa: E731
                                 generator=generator)
    q, k, v, grad_out = make(heads), make(kv_heads), make(kv_heads), make(heads)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with step_layout(layout):
        out = attention.torch_varlen_attention(*inputs, scale, window)   # (1, T, heads, dim)
    out.backward(grad_out.transpose(1, 2))
    assert seen == [heads if attention.VARLEN_GQA == "repeat" else kv_heads]
    expected, expected_grads, terms = _reference_attention(q, k, v, grad_out, lengths, scale, window)
    for name, got, want in (("out", out.transpose(1, 2), expected), *zip("qkv", (t.grad for t in inputs),
                                                                         expected_grads, strict=True)):
        bound = rounding_tolerance(ATTENTION_ROUNDINGS, terms[name], BF16) + rounding_tolerance(
            2 * (dim + max(lengths)), terms[name])   # and float32's own sums
        assert float((got.detach().float() - want).abs().max()) <= bound, name


# -- Liger's kernels in bfloat16 ----------------------------------------------------------------------------------

def bf16_roundings(config, backward: bool) -> int:
    """bfloat16 results along the longest chain of a Llama-like model, per layer: the input norm, a projection,
    RoPE's three (product, product, sum; Liger's one), attention's two, o_proj, the residual sum, the second norm,
    gate / up, the activation, their product, down, the residual sum; then the final norm and the head. The
    backward pass rounds as many again."""
    forward = 15 * config.num_hidden_layers + 2
    return 2 * forward if backward else forward


def _on_gpu(model: torch.nn.Module) -> torch.nn.Module:
    return model.to("cuda", BF16)


@needs_liger
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("ops", [("rms_norm",), ("add_rms_norm",), ("rope",), ("swiglu",), ("loss",),
                                 kernels.OPS],
                         ids=["rms_norm", "add_rms_norm", "rope", "swiglu", "loss", "all"])
def test_each_kernel_in_bfloat16_gives_the_model_s_results(monkeypatch, model_type, ops):
    spied = spy_on_liger(monkeypatch)
    model = _on_gpu(tiny(model_type))
    reference = fused_step(copy.deepcopy(model), ())
    got = fused_step(model, ops)
    for op, counted in SPIED.items():
        assert (spied[counted] > 0) == (op in ops), (op, dict(spied))
    for key, expected in reference.items():
        roundings = bf16_roundings(model.config, backward=key not in ("hidden", "losses"))
        bound = rounding_tolerance(roundings, float(expected.abs().max()), BF16)
        assert float((got[key] - expected).abs().max()) <= bound, key


@needs_liger
def test_layers_computed_together_run_rope_and_swiglu_where_their_columns_lie(monkeypatch):
    """Adapters of rank 8 on every layer of a tiny Llama in bfloat16 with Liger's kernels: on a Hopper GPU q/k/v and
    gate/up are computed together over their weights stacked as rows of one tensor (actors/engine/lora_siblings.py,
    sibling_weights.py), RoPE and SwiGLU run on their columns where they lie (strided_kernels.py: Liger's RoPE and
    SwiGLU functions are not called), and the step's results are the layers' computed one by one, within the
    bfloat16 chain's bound."""
    from actors.engine import lora_siblings

    if torch.cuda.get_device_capability() < (9, 0) or not lora_siblings.views_work(torch.device("cuda")):
        pytest.skip("the layers are computed together on sm90 and newer (torch._grouped_mm)")
    model = _on_gpu(tiny("llama"))
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "off")
    reference = fused_step(copy.deepcopy(model), kernels.OPS, rank=8)
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    spied = spy_on_liger(monkeypatch)
    got = fused_step(model, kernels.OPS, rank=8)
    assert spied["liger_rope"] == spied["liger_swiglu"] == 0, dict(spied)
    layer = model.model.layers[0]
    for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
        weights = [getattr(parent, name).base.weight for name in names]
        assert len({weight.untyped_storage().data_ptr() for weight in weights}) == 1, names
    for key, expected in reference.items():
        roundings = bf16_roundings(model.config, backward=key not in ("hidden", "losses"))
        bound = rounding_tolerance(roundings, float(expected.abs().max()), BF16)
        assert float((got[key] - expected).abs().max()) <= bound, key


@needs_liger
def test_auto_applies_liger_on_cuda_in_bfloat16():
    model = _on_gpu(tiny("llama"))
    assert from_module(model, None, kernels="auto").kernels == "liger"
    # per layer the layer (the fused addition and norm), its two norms, its MLP and its attention; the final norm
    assert len(forwards_rebound(model)) == 5 * model.config.num_hidden_layers + 1


@needs_liger
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(multiply=0.5, softcap=3.0)],
                         ids=["plain", "multiply+softcap"])
def test_the_fused_loss_in_bfloat16_against_float64(transform):
    rows, hidden_size, chunk = 300, 256, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=generator).to(BF16)
    weight = torch.nn.Parameter((torch.randn(VOCAB * 8, hidden_size, device="cuda", generator=generator) * 0.05)
                                .to(BF16), requires_grad=False)
    targets = torch.randint(0, VOCAB * 8, (rows,), device="cuda", generator=generator)
    token_weights = torch.rand(rows, device="cuda", generator=generator) + 0.5
    use_fused_loss(weight, "liger")
    fused_input = hidden.clone().requires_grad_(True)
    total, losses = target_cross_entropy(fused_input, weight, None, targets, token_weights, chunk, transform)
    total.backward()
    exact_input = hidden.double().requires_grad_(True)
    logits = exact_input @ weight.double().T * transform.multiply / transform.divide
    if transform.softcap is not None:
        logits = transform.softcap * torch.tanh(logits / transform.softcap)
    exact = F.cross_entropy(logits, targets, reduction="none")
    (exact * token_weights.double()).sum().backward()
    # the loss: every logit rounded once to bfloat16 (the log-sum-exp and the target's logit move by at most
    # u * max |logit| each); the gradient: the probabilities move by 2u * max |logit| relative, and d loss / d logits,
    # the product with the head and the token weight's product are rounded (3u of the sum of |terms|, at most
    # 2 max |W| per row: |softmax - one-hot| sums to at most 2), times the largest token weight
    largest_logit = float(logits.abs().max())
    row_terms = 2 * float(weight.abs().max()) * abs(transform.slope) * float(token_weights.max())
    loss_bound = 2 * U * largest_logit + rounding_tolerance(hidden_size + VOCAB * 8, largest_logit)
    grad_bound = (3 * U + 2 * U * largest_logit) * row_terms
    assert float((losses.double() - exact.detach()).abs().max()) <= loss_bound
    assert float((fused_input.grad.double() - exact_input.grad).abs().max()) <= grad_bound
