"""Interactive models (the Tinker API's) for tests: a model whose B matrices are random, so that its adapter
changes the outputs, and the PEFT model with the same adapter, as the independent reference."""

from __future__ import annotations

import torch

from actors.engine.interactive_model import LORA_ALPHA, InteractiveModel
from actors.engine.interactive_step import CallDatum
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.peft_reference import peft_lora


def random_b_model(base, name: str, rank: int, seed: int, *, scale: float = 0.3) -> InteractiveModel:
    made = InteractiveModel(base, name, rank, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter_name, parameter in made.adapter.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    return made


def peft_twin(model: InteractiveModel):
    """A PEFT LoRA model on a fresh copy of the tiny llama with `model`'s adapter weights."""
    from peft import LoraConfig, get_peft_model

    targets = sorted({name.split(".")[-3] for name, _ in model.adapter.named_parameters()})
    reference = get_peft_model(tiny_model("llama", VOCAB), LoraConfig(r=model.rank, lora_alpha=LORA_ALPHA,
                                                                      target_modules=targets, lora_dropout=0.0))
    weights = peft_lora(reference)
    with torch.no_grad():
        for name, parameter in model.adapter.named_parameters():
            weights[name].copy_(parameter)
    return reference, weights


def datum(seed: int, length: int, *, rl: bool = False, vocab: int = VOCAB) -> CallDatum:
    """A random datum: supervised (target tokens and weights) or, with `rl`, with sampling logprobs and advantages."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length,), generator=generator)
    inputs = {"target_tokens": torch.randint(0, vocab, (length,), generator=generator)}
    if rl:
        inputs["logprobs"] = -torch.rand(length, generator=generator) * 5
        inputs["advantages"] = torch.randn(length, generator=generator)
    else:
        inputs["weights"] = (torch.rand(length, generator=generator) > 0.3).float()
    return CallDatum(tuple(tokens.tolist()), inputs)
