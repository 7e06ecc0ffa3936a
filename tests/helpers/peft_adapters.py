"""Adapters as PEFT saves them, for tests that start from or try a saved adapter: PEFT's LoRA on a saved model
folder, its B drawn at random (a trained adapter's B is not PEFT's zeros), written by `save_pretrained`."""

from __future__ import annotations

from pathlib import Path

import torch


def saved_peft_lora(model_dir: str | Path, folder: Path, targets: list[str], *, seed: int, scale: float = 0.3,
                    r: int = 4, alpha: int = 8) -> Path:
    """A PEFT LoRA (r, alpha, `targets`) of the model in `model_dir`, lora_B ~ N(0, scale^2) from `seed`, saved in
    `folder`; returns `folder`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
                           PeftLoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.save_pretrained(folder)
    return folder
