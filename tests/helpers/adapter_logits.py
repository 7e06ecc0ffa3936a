"""An adapter's logits through aspen's fused layers (with autograd), and PEFT's dropout made to draw aspen's
masks: what the adapter-kind tests compare PEFT against."""

from __future__ import annotations

import torch

from actors.engine.layout import StepLayout, step_layout


def aspen_logits(model, adapter: str, ids: torch.Tensor) -> torch.Tensor:
    """The fused model's logits through one adapter, with autograd (FusedTrainer.logits' layout)."""
    rows, length = ids.shape
    with step_layout(StepLayout.single(adapter, [length] * rows)):
        out = model(input_ids=ids.reshape(1, -1), position_ids=torch.arange(length).repeat(rows)[None],
                    attention_mask=None, use_cache=False)
    return out.logits.reshape(rows, length, -1)


class SameMask(torch.nn.Module):
    """PEFT's lora_dropout replaced by the inverted-dropout masks aspen's adapter draws (a generator in the
    same state, one draw per layer in the same order): both forwards then drop the same inputs."""

    def __init__(self, p: float, generator: torch.Generator):
        super().__init__()
        self.p, self.generator = p, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.empty_like(x).bernoulli_(1 - self.p, generator=self.generator).div_(1 - self.p)
