"""Chunked target loss against full-logits cross-entropy; packed/padded layouts against HF attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.data import Example
from actors.engine.layout import step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch, pack
from tests.helpers.models import random_examples, tiny_model


def test_chunked_loss_and_gradient_equal_full_cross_entropy():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    bias = torch.randn(50, dtype=torch.float64)
    targets = torch.randint(0, 50, (37,))
    token_weights = torch.rand(37, dtype=torch.float64)
    total, losses = target_cross_entropy(hidden, weight, bias, targets, token_weights, chunk=8)
    (total * 3.0).backward()
    got_grad = hidden.grad.clone()

    hidden.grad = None
    reference = F.cross_entropy(hidden @ weight.T + bias, targets, reduction="none")
    ((reference * token_weights).sum() * 3.0).backward()
    torch.testing.assert_close(losses.double(), reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.double(), (reference * token_weights).sum().detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, hidden.grad, rtol=1e-4, atol=1e-6)


def test_packed_layout_has_no_padding_and_restarts_positions():
    a = [Example((5, 6, 7), (-100, 6, 7)), Example((8, 9), (-100, 9))]
    b = [Example((1, 2, 3, 4), (-100, -100, 3, 4))]
    batch = pack([JobMicroBatch("a", a), JobMicroBatch("b", b)], "packed", pad_token_id=0)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert batch.padding_tokens == 0
    assert batch.layout.segments == (("a", 0, 5), ("b", 5, 9))
    assert batch.layout.sequences == ((0, 3), (3, 5), (5, 9))
    # position t predicts the label at t + 1, never across a sequence boundary
    assert batch.target_index.tolist() == [0, 1, 3, 6, 7]
    assert batch.target_ids.tolist() == [6, 7, 9, 3, 4]
    assert batch.target_job.tolist() == [0, 0, 0, 1, 1]
    assert batch.job_targets == [3, 2] and batch.job_tokens == [5, 4]


def test_padded_layouts_count_their_padding():
    a = [Example((1,) * 3, (-100,) * 3), Example((1,) * 5, (-100,) * 5)]
    b = [Example((1,) * 9, (-100,) * 9)]
    per_job = pack([JobMicroBatch("a", a), JobMicroBatch("b", b)], "padded")
    fused = pack([JobMicroBatch("a", a), JobMicroBatch("b", b)], "padded_fused")
    assert per_job.padding_tokens == 2 and per_job.num_tokens == 19
    assert fused.padding_tokens == 6 + 4 and fused.num_tokens == 27
    assert per_job.position_ids.tolist()[:10] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]


def test_packed_stream_hidden_states_equal_each_sequence_run_alone():
    """Block-diagonal attention: a packed sequence sees exactly what it sees alone (reference: HF sdpa)."""
    model = tiny_model("qwen2", vocab_size=300)
    base = from_module(model, None)
    examples = random_examples(0, count=5, vocab=300)
    batch = pack([JobMicroBatch("x", examples[:2]), JobMicroBatch("y", examples[2:])], "padded")
    with torch.no_grad(), step_layout(batch.layout):
        packed = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    base.model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for (start, _), example in zip(batch.layout.sequences, examples, strict=True):
            alone = base.decoder(input_ids=torch.tensor([example.input_ids]), use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(packed[start:start + len(example)], alone, rtol=1e-4, atol=1e-5)
