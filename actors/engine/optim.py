"""Per-job optimisation: AdamW over the job's adapter, its learning-rate schedule, gradient
accumulation bookkeeping, grad-norm clipping and (for a float16 base) dynamic loss scaling.

Gradient accumulation is token-weighted, as in Hugging Face's Trainer since 4.46: every target token of
every micro-batch of an optimizer step counts once, so the step's gradient is that of the sum of its
tokens' losses divided by the number of its target tokens (not the mean of the micro-batches' means,
which lets a short micro-batch's tokens weigh more than a long one's). The fused step backpropagates
each token's loss with weight 1 (times the job's loss scale), the adapter's float32 gradients sum them,
and `step(targets)` divides by the step's target count (and the scale) before clipping. Several jobs' steps
taken together, in a few multi-tensor operations: actors/engine/joint_steps.py."""

from __future__ import annotations

import math

import torch

from actors.engine.flat_adamw import FlatAdamW
from actors.spec.job_spec import JobSpec


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


class LossScale:
    """Dynamic loss scaling of one job on a float16 base (torch.amp.GradScaler's rule, kept per job so that
    no job's overflow changes another's step): each token's loss is backpropagated times `scale`, so that
    small activation gradients do not underflow float16; a step whose gradients hold inf or NaN is skipped
    and the scale halved; after `growth_interval` clean steps in a row it doubles.

    Tokens weigh 1 each (not 1/N), so activation gradients do not shrink with the step's size: the initial
    scale is 2**10 rather than GradScaler's 2**16 (which assumes a mean over the batch's tokens)."""

    INITIAL = 2.0**10
    GROWTH, BACKOFF, GROWTH_INTERVAL = 2.0, 0.5, 1000
    MIN, MAX = 2.0**-24, 2.0**24

    def __init__(self, scale: float = INITIAL, clean_steps: int = 0):
        self.scale = float(scale)
        self.clean_steps = int(clean_steps)
        self.skipped_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.BACKOFF, self.MIN)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.GROWTH_INTERVAL:
            self.scale = min(self.scale * self.GROWTH, self.MAX)
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}


class JobOptimizer:
    """AdamW + schedule for one job; `micro_step_done()` tells when its accumulation is complete.
    `loss_scaling`: dynamic loss scaling (for a float16 base; bfloat16 and float32 need none).
    LoRA+ (`spec.lora.loraplus_lr_ratio`): `fast_parameters` (B and DoRA's magnitudes, a subset of
    `parameters`) form a second parameter group at lr * ratio, the others stay at lr; both follow the
    schedule (each group's lr is its own peak times the schedule's factor, as torch's LambdaLR)."""

    def __init__(self, spec: JobSpec, parameters: list[torch.nn.Parameter], total_steps: int, *,
                 loss_scaling: bool = False, fast_parameters: list[torch.nn.Parameter] | None = None):
        self.spec = spec
        self.parameters = parameters
        self.total_steps = total_steps
        ratio = spec.lora.loraplus_lr_ratio
        groups: list[dict] = [{"params": parameters, "lr_ratio": 1.0}]
        if ratio is not None:
            if not fast_parameters:
                raise ValueError(f"job '{spec.name}': lora.loraplus_lr_ratio needs the adapter's B parameters "
                                 "(fast_parameters)")
            fast = {id(p) for p in fast_parameters}
            groups = [{"params": [p for p in parameters if id(p) not in fast], "lr_ratio": 1.0},
                      {"params": [p for p in parameters if id(p) in fast], "lr_ratio": float(ratio)}]
        self.optimizer = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay,
                                           **fused_option(parameters))
        self.step_count = 0
        self.micro_count = 0
        self.loss_scale = LossScale() if loss_scaling else None
        # per parameter group, the tensors `joint_steps.step_jobs` hands AdamW (`_group_lists` there); emptied
        # when the state is loaded
        self.group_lists: dict[int, tuple] = {}
        self.set_lr()

    @property
    def flat(self) -> FlatAdamW | None:
        """The one-pass AdamW over the job's pooled adapter (actors/engine/flat_adamw.py) where it can take this
        job's steps on a device (`joint_steps._step_flat`), else None. Looked for once: the parameters never
        change."""
        if "_flat" not in self.__dict__:
            self._flat = FlatAdamW.of(self.optimizer, self.parameters) if batchable(self) else None
        return self._flat

    def leave_flat(self) -> None:
        """torch's AdamW is to step the job now: the parameters' step counts brought up to date, and the flat
        moments adopted again at the next flat step (torch's step changes them and the counts)."""
        flat = self.__dict__.get("_flat")
        if flat is not None:
            flat.release()

    @property
    def token_weight(self) -> float:
        """What each target token's loss is backpropagated with: 1, or the loss scale."""
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    @property
    def lr_factor(self) -> float:
        return lr_factor(self.step_count, schedule=self.spec.lr_schedule, warmup_steps=self.spec.warmup_steps,
                         total_steps=self.total_steps)

    @property
    def lr(self) -> float:
        """The job's learning rate now (LoRA+: A's; B's is lr_ratio times it)."""
        return self.spec.lr * self.lr_factor

    def set_lr(self) -> None:
        factor = self.lr_factor
        for group in self.optimizer.param_groups:
            ratio = group.get("lr_ratio", 1.0)
            group["lr"] = self.spec.lr * factor if ratio == 1.0 else self.spec.lr * ratio * factor

    def micro_step_done(self) -> bool:
        """Count one micro-batch; True when an optimizer step is due."""
        self.micro_count += 1
        return self.micro_count % self.spec.grad_accum == 0

    def step(self, targets: int) -> tuple[float, float]:
        """Turn the summed gradients of the step's `targets` target tokens into their mean, clip, step, zero
        the gradients. Returns (lr used, gradient norm before clipping; inf for a step skipped because its
        float16 gradients overflowed)."""
        lr = self.lr
        self.leave_flat()
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self.token_weight * max(targets, 1))
        if self.loss_scale is not None:
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
            self.loss_scale.update(finite)
            if not finite:   # as torch's GradScaler: the step is skipped, the schedule goes on
                self.optimizer.zero_grad(set_to_none=True)
                self.step_count += 1
                self.set_lr()
                return lr, float("inf")
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
        """The bytes of the adapter's gradients (its parameters', counted once: they never change)."""
        counted = self.__dict__.get("_gradient_bytes")
        if counted is None:
            counted = self._gradient_bytes = sum([p.numel() * p.element_size() for p in self.parameters])
        return counted

    def state_bytes(self) -> int:
        """Adam keeps two moments per parameter (allocated at the first step; counted from the start)."""
        return 2 * self.gradient_bytes()

    def state_dict(self) -> dict:
        flat = self.__dict__.get("_flat")
        if flat is not None:
            flat.sync_steps()
        state = {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count,
                 "micro_count": self.micro_count}
        if self.loss_scale is not None:
            state["loss_scale"] = self.loss_scale.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.group_lists.clear()   # the moments are new tensors now
        self.step_count = state["step_count"]
        self.micro_count = state["micro_count"]
        if self.loss_scale is not None and state.get("loss_scale"):
            self.loss_scale = LossScale(**state["loss_scale"])
        self.set_lr()


def batchable(optimizer: JobOptimizer) -> bool:
    """A job whose step `joint_steps.step_jobs` may take with others': fused AdamW, no loss scale (a float16 job's
    overflow check stays its own), no amsgrad / maximize. Its parameter groups (two with LoRA+) each join
    the AdamW call of their own hyperparameters."""
    if optimizer.loss_scale is not None:
        return False
    return all(bool(group["fused"]) and not group["amsgrad"] and not group["maximize"] and not group["capturable"]
               for group in optimizer.optimizer.param_groups)
