"""Grouped-query attention through torch's varlen kernel without repeating keys and values (actors/engine/
attention.py, `VARLEN_GQA`), on the CPU: which way each torch takes grouped heads (the flag from 2.12, natively on
2.10 / 2.11, repeated otherwise), and that the varlen call gets the key / value heads as they are in the first two
ways and repeated in the third, with the window and the sequences it should. torch's kernel runs on CUDA only: here
a stand-in with its documented semantics (each sequence of cu_seqlens alone, keys from i - left to i, FlashAttention's
head grouping: query head h reads key/value head h // (heads / kv_heads)) receives the call, and the result is
compared with attention computed by hand in float64, the key/value heads repeated. The kernel itself:
tests/gpu/test_kernels_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.engine import attention
from actors.engine.attention import torch_varlen_attention, varlen_gqa_mode
from actors.engine.layout import StepLayout, step_layout
from tests.helpers.tolerances import rounding_tolerance

LENGTHS = [7, 12, 3, 9]
HEADS, KV_HEADS, DIM = 6, 2, 8


def varlen_with_flag(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """torch >= 2.12's signature."""


def varlen_without_flag(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
    """torch 2.10 / 2.11's signature (torch/nn/attention/varlen.py at 2.11: no enable_gqa, no head-count check)."""


def test_each_torch_takes_grouped_heads_its_own_way():
    assert varlen_gqa_mode(varlen_with_flag, "2.13.0") == "flag"
    assert varlen_gqa_mode(varlen_with_flag, "2.12.0+cu130") == "flag"
    assert varlen_gqa_mode(varlen_without_flag, "2.11.0+cu130") == "native"
    assert varlen_gqa_mode(varlen_without_flag, "2.10.1") == "native"
    assert varlen_gqa_mode(varlen_without_flag, "2.12.0") == "repeat"   # a later torch without the flag: unknown
    assert varlen_gqa_mode(None, "2.11.0") == "repeat"


class StandIn:
    """torch's varlen_attn on CPU tensors, recording what it was given."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
        self.calls.append({"key_heads": key.shape[1], "value_heads": value.shape[1], "enable_gqa": enable_gqa,
                           "cu_seq": cu_seq_q.tolist(), "max": (max_q, max_k), "window": window_size})
        left, right = window_size
        assert right == 0, "causal"
        outputs = []
        for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), strict=True):
            position = torch.arange(end - start)
            distance = position[:, None] - position[None, :]
            allowed = (distance >= 0) & ((distance <= left) if left >= 0 else True)
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs)


def by_hand(query, key, value, lengths, scale, window):
    """(1, heads, T, dim) float64 attention of each sequence alone, causal within `window`, query head h reading
    key/value head h // groups."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out, start = [], 0
    for length in lengths:
        q, k, v = (t[0, :, start:start + length].double() for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) * scale
        i = torch.arange(length)
        allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or length + 1))
        out.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v)
        start += length
    return torch.cat(out, dim=1).transpose(0, 1)[None]   # (1, T, heads, dim)


@pytest.mark.parametrize("mode", ["flag", "native", "repeat"])
@pytest.mark.parametrize("window", [None, 4])
def test_the_varlen_call_gets_the_grouped_heads_as_the_torch_takes_them(monkeypatch, mode, window):
    stand_in = StandIn()
    monkeypatch.setattr(attention, "torch_varlen_attn", stand_in)
    monkeypatch.setattr(attention, "VARLEN_GQA", mode)
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    query = torch.randn(1, HEADS, tokens, DIM, generator=generator)
    key, value = (torch.randn(1, KV_HEADS, tokens, DIM, generator=generator) for _ in range(2))
    with step_layout(StepLayout.single("job", LENGTHS)):
        out = torch_varlen_attention(query, key, value, 0.3, window)
    (call,) = stand_in.calls
    expected_heads = HEADS if mode == "repeat" else KV_HEADS
    assert call["key_heads"] == call["value_heads"] == expected_heads
    assert call["enable_gqa"] is (mode == "flag")
    assert call["cu_seq"] == [0, 7, 19, 22, 31] and call["max"] == (12, 12)
    assert call["window"] == ((window - 1, 0) if window else (-1, 0))
    expected = by_hand(query, key, value, LENGTHS, 0.3, window)
    assert out.shape == (1, tokens, HEADS, DIM)
    # float32 sums over the head dimension and the keys of a sequence, against float64
    bound = rounding_tolerance(DIM + 2 * max(LENGTHS), float(value.abs().max()))
    assert float((out.double() - expected).abs().max()) <= bound


def test_the_kernels_gradients_reach_the_projections_token_major(monkeypatch):
    """The query, key and value come in as (1, heads, T, dim) views of the projections' token-major outputs; the
    kernel's gradients are token-major (T, heads, dim). They must reach the projections in that order, as views: a
    head-major copy (what `tensor[0]`'s backward makes) costs a fill and a copy per tensor and a layer, then Liger's
    RoPE backward and the value's view backward copy it back."""
    stand_in = StandIn()
    monkeypatch.setattr(attention, "torch_varlen_attn", stand_in)
    monkeypatch.setattr(attention, "VARLEN_GQA", "native")
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    # as a model makes them: projections' outputs (1, T, heads·dim) viewed per head, heads before tokens
    made = [torch.randn(1, tokens, heads * DIM, generator=generator, requires_grad=True)
            for heads in (HEADS, KV_HEADS, KV_HEADS)]
    query, key, value = (t.view(1, tokens, -1, DIM).transpose(1, 2) for t in made)
    seen = []
    for tensor in (query, key, value):
        tensor.register_hook(seen.append)
    with step_layout(StepLayout.single("job", LENGTHS)):
        out = torch_varlen_attention(query, key, value, 0.3, None)
    # the stand-in's gradients as a varlen kernel's: token-major (T, heads, dim)
    out.backward(torch.randn(out.shape, generator=generator))
    assert len(seen) == 3
    for grad in seen:
        assert grad.transpose(1, 2).is_contiguous(), "the gradient was copied head-major on its way back"
