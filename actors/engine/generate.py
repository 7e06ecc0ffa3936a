"""Batched greedy decoding through one adapter (or the base model alone) with the fused LoRA layers.

No KV cache: at every step the unfinished sequences (prompt plus the tokens generated so far) are packed
back to back into one row with position ids restarting per sequence, run through the decoder once under
a `StepLayout` whose single segment names the adapter, and the LM head is applied only at each
sequence's last position. Meant for evaluation of small models on short prompts, where recomputing the
prefix is cheap and the code stays independent of transformers' cache classes."""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora import FusedLoraLinear, set_adapters_training
from actors.engine.models import BaseModel

BASE_ONLY = "__base__"
"""A segment name attached to no layer: tokens under it go through the base model alone."""


def _adapter_training_states(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(module.adapters, module.adapters.training) for module in model.modules()
            if isinstance(module, FusedLoraLinear)]


def _is_attached(model: nn.Module, adapter: str) -> bool:
    return any(isinstance(m, FusedLoraLinear) and adapter in m.adapters for m in model.modules())


@torch.no_grad()
def greedy_generate(base: BaseModel, adapter: str | None, prompts: list[list[int]], max_new_tokens: int,
                    stop_token_ids: set[int]) -> list[list[int]]:
    """Greedy continuations of `prompts` through `adapter` (None: the base model alone).

    Returns, per prompt, the generated tokens only (not the prompt); a sequence ends after
    `max_new_tokens` tokens or at the first token in `stop_token_ids`, which is kept as its last token
    (as `transformers` `generate` keeps the EOS token)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {index} is empty; greedy decoding needs at least one token")
    model = base.model
    if adapter is not None and not _is_attached(model, adapter):
        raise ValueError(f"no adapter named '{adapter}' is attached to the model")
    segment_name = BASE_ONLY if adapter is None else adapter
    outputs: list[list[int]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts))] if max_new_tokens > 0 else []
    states = _adapter_training_states(model)
    set_adapters_training(model, False)
    try:
        while active:
            sequences = [list(prompts[i]) + outputs[i] for i in active]
            lengths = [len(s) for s in sequences]
            flat = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=base.device)
            positions = torch.cat([torch.arange(n, device=base.device) for n in lengths])
            ends = torch.tensor(lengths, device=base.device).cumsum(0) - 1
            layout = StepLayout.single(segment_name, lengths)
            with step_layout(layout):
                hidden = base.decoder(input_ids=flat[None], position_ids=positions[None], attention_mask=None,
                                      use_cache=False).last_hidden_state[0]
            logits = base.output_logits(hidden[ends])   # the model's logit transform included
            chosen = logits.argmax(dim=-1).tolist()
            still_active = []
            for i, token in zip(active, chosen, strict=True):
                outputs[i].append(int(token))
                if int(token) not in stop_token_ids and len(outputs[i]) < max_new_tokens:
                    still_active.append(i)
            active = still_active
    finally:
        for adapters, training in states:
            adapters.train(training)
    return outputs
