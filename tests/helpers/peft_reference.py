"""PEFT LoRA models as references for aspen's adapters: the shared LoRA config of the method tests (TRL's
trainers on a PEFT model), random B matrices so that an adapter changes the outputs, PEFT's parameters by
aspen's names, and gradients compared entry by entry."""

from __future__ import annotations

import torch

TARGETS = ["q_proj", "v_proj"]


def peft_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def randomize_b(model, seed: int):
    """PEFT's B matrices random (not its zeros), so that the adapter changes the log-probabilities and both
    A and B get gradients."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def peft_lora(model) -> dict[str, torch.nn.Parameter]:
    """PEFT's LoRA parameters by aspen's names (`model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return {name.removeprefix("base_model.model.").replace(".default", ""): parameter
            for name, parameter in model.named_parameters() if "lora_" in name}


def compare_gradients(job, pairs: int, peft_model) -> tuple[float, float]:
    """The largest difference between aspen's gradient (summed over the pairs, divided here by their
    number as its optimizer does) and PEFT's (TRL's loss is the mean over the batch), and PEFT's largest
    gradient entry."""
    reference = peft_lora(peft_model)
    worst, largest = 0.0, 0.0
    for name, parameter in job.adapter.named_parameters():
        expected = reference[name].grad
        assert expected is not None and parameter.grad is not None, name
        worst = max(worst, float((parameter.grad / pairs - expected).abs().max()))
        largest = max(largest, float(expected.abs().max()))
    assert largest > 1e-4, "TRL's gradients are all zero: nothing was compared"
    return worst, largest


def copy_peft_lora(job, peft_model) -> None:
    """Give aspen's job (a TrainingJob) PEFT's LoRA weights, so that both start alike."""
    weights = peft_lora(peft_model)
    with torch.no_grad():
        for name, parameter in job.adapter.named_parameters():
            parameter.copy_(weights[name])
