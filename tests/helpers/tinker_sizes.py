"""The memory a trainer and an adapter hold, counted independently of the scheduler: the trainer's fixed memory as a
running service reports it, and LoRA adapters' memory from the base's layer shapes (LoRA's A and B, fp32 weight,
gradient and two AdamW moments per parameter). Shared by the Tinker service tests that size a trainer's budget."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from orchestrator.client import Client
from tests.helpers.service import wait_for

BYTES_PER_PARAMETER = 4 * 4   # fp32 weight, gradient, AdamW exp_avg and exp_avg_sq
JOB_RANK = 1024               # the job's adapter: every linear layer (PEFT's all-linear: not the LM head)
MODEL_RANK = 256              # the SDK's model: attention, MLP and the LM head (its defaults), at aspen's largest rank


def lora_bytes(base: str) -> tuple[int, int]:
    """(the job's, the model's) adapter memory, from the base's linear layers."""
    model = AutoModelForCausalLM.from_pretrained(base)
    layers = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    sides = sum(m.in_features + m.out_features for m in layers)
    head = model.get_output_embeddings()
    return (BYTES_PER_PARAMETER * JOB_RANK * sides,
            BYTES_PER_PARAMETER * MODEL_RANK * (sides + head.in_features + head.out_features))


def fixed_bytes(client: Client) -> int:
    """The trainer's weights and a full step's memory, as the scheduler counts them."""
    ready = wait_for(lambda: [t for t in client.trainers() if t["ready"]], what="a trainer ready", timeout=300)[0]
    return ready["memory_fixed_bytes"] + ready["memory_step_bytes"]
