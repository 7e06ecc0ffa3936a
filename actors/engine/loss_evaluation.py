"""What a trainer computes of its jobs' adapters between steps, without gradients: a job's mean loss over examples
(its eval split: the early-stop rule's and the reports' eval loss) and one adapter's full logits on equal-length
rows (the model's own forward, its logit transform included: greedy decoding and the tests' references)."""

from __future__ import annotations

import torch

from actors.data import Example
from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch, pack


@torch.no_grad()
def mean_loss(base: BaseModel, adapter: str, examples: list[Example], batch_size: int, loss_chunk: int) -> float:
    """Mean loss over the target tokens of `examples` through `adapter`, `batch_size` examples packed at a time."""
    loss_sum, count = 0.0, 0
    head = base.lm_head
    for start in range(0, len(examples), batch_size):
        batch = pack([JobMicroBatch(adapter, examples[start:start + batch_size])], "packed",
                     base.pad_token_id).to(base.device)
        with step_layout(batch.layout):
            hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                  attention_mask=None, use_cache=False).last_hidden_state[0]
        weights = torch.ones(batch.target_ids.numel(), device=hidden.device)
        total, _ = target_cross_entropy(hidden[batch.target_index], head.weight, head.bias,
                                        batch.target_ids, weights, loss_chunk, base.logit_transform)
        loss_sum += float(total)
        count += int(batch.target_ids.numel())
    return loss_sum / max(count, 1)


def adapter_logits(base: BaseModel, adapter: str, input_ids: torch.Tensor) -> torch.Tensor:
    """Full logits of `adapter` on a (batch, length) tensor of unpadded equal-length rows, its dropout off."""
    set_adapters_training(base.model, False)
    rows, length = input_ids.shape
    layout = StepLayout.single(adapter, [length] * rows)
    flat = input_ids.reshape(1, -1).to(base.device)
    positions = torch.arange(length, device=base.device).repeat(rows)[None]
    try:
        with step_layout(layout):
            out = base.model(input_ids=flat, position_ids=positions, attention_mask=None, use_cache=False)
    finally:
        set_adapters_training(base.model, True)
    return out.logits.reshape(rows, length, -1)
