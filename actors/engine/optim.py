"""Per-job optimisation: AdamW over the job's adapter, its learning-rate schedule, gradient
accumulation bookkeeping and grad-norm clipping."""

from __future__ import annotations

import math

import torch

from actors.engine.spec import JobSpec


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule '{schedule}' (constant, linear or cosine)")


FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_option(parameters: list[torch.nn.Parameter]) -> dict[str, bool]:
    """AdamW's fused kernel where torch has one (CPU, CUDA; float parameters on one device): one kernel per
    step instead of a dozen small operations per parameter. An adapter has hundreds of small parameters
    (2 per targeted layer), so on a GPU the per-parameter way is hundreds of launches per job and step,
    and on the CPU the fused kernel steps 4 jobs of smollm2-135m adapters in ~30 ms against ~60-85 ms.
    Elsewhere torch's default."""
    devices = {p.device for p in parameters}
    if (len(devices) == 1 and next(iter(devices)).type in FUSED_DEVICES
            and all(p.dtype in FUSED_DTYPES for p in parameters)):
        return {"fused": True}
    return {}


class JobOptimizer:
    """AdamW + schedule for one job; `ready()` tells when its accumulation is complete."""

    def __init__(self, spec: JobSpec, parameters: list[torch.nn.Parameter], total_steps: int):
        self.spec = spec
        self.parameters = parameters
        self.total_steps = total_steps
        self.optimizer = torch.optim.AdamW(parameters, lr=spec.lr, weight_decay=spec.weight_decay,
                                           **fused_option(parameters))
        self.step_count = 0
        self.micro_count = 0
        self.set_lr()

    @property
    def lr(self) -> float:
        return self.spec.lr * lr_factor(self.step_count, schedule=self.spec.lr_schedule,
                                        warmup_steps=self.spec.warmup_steps, total_steps=self.total_steps)

    def set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def micro_step_done(self) -> bool:
        """Count one micro-batch; True when an optimizer step is due."""
        self.micro_count += 1
        return self.micro_count % self.spec.grad_accum == 0

    def step(self) -> tuple[float, float]:
        """Clip, step, zero the gradients. Returns (lr used, gradient norm before clipping)."""
        lr = self.lr
        if self.spec.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, self.spec.max_grad_norm))
        else:
            grads = [p.grad for p in self.parameters if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.set_lr()
        return lr, norm

    def gradient_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters)

    def state_bytes(self) -> int:
        """Adam keeps two moments per parameter (allocated at the first step; counted from the start)."""
        return 2 * self.gradient_bytes()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count,
                "micro_count": self.micro_count}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = state["step_count"]
        self.micro_count = state["micro_count"]
        self.set_lr()
