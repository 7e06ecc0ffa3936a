"""Per-job optimisation: AdamW over the job's adapter, its learning-rate schedule, gradient
accumulation bookkeeping, grad-norm clipping and (for a float16 base) dynamic loss scaling.

Gradient accumulation is token-weighted, as in Hugging Face's Trainer since 4.46: every target token of
every micro-batch of an optimizer step counts once, so the step's gradient is that of the sum of its
tokens' losses divided by the number of its target tokens (not the mean of the micro-batches' means,
which lets a short micro-batch's tokens weigh more than a long one's). The fused step backpropagates
each token's loss with weight 1 (times the job's loss scale), the adapter's float32 gradients sum them,
and `step(targets)` divides by the step's target count (and the scale) before clipping."""

from __future__ import annotations

import math

import torch
from torch.optim.adam import adam as functional_adam

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
        # per parameter group, the tensors `step_jobs` hands AdamW (`_group_lists`); emptied when the state is loaded
        self.group_lists: dict[int, tuple] = {}
        self.set_lr()

    @property
    def flat(self) -> FlatAdamW | None:
        """The one-pass AdamW over the job's pooled adapter (actors/engine/flat_adamw.py) where it can take this
        job's steps on a device (`_step_flat`), else None. Looked for once: the parameters never change."""
        if "_flat" not in self.__dict__:
            self._flat = FlatAdamW.of(self.optimizer, self.parameters) if _batchable(self) else None
        return self._flat

    def _leave_flat(self) -> None:
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
        self._leave_flat()
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


def _batchable(optimizer: JobOptimizer) -> bool:
    """A job whose step `step_jobs` may take with others': fused AdamW, no loss scale (a float16 job's
    overflow check stays its own), no amsgrad / maximize. Its parameter groups (two with LoRA+) each join
    the AdamW call of their own hyperparameters."""
    if optimizer.loss_scale is not None:
        return False
    return all(bool(group["fused"]) and not group["amsgrad"] and not group["maximize"] and not group["capturable"]
               for group in optimizer.optimizer.param_groups)


def step_jobs(optimizers: list[JobOptimizer], targets: list[int], *, on_device: bool = False
              ) -> list[tuple[float, float | torch.Tensor]]:
    """The optimizer steps of several jobs at once (`JobOptimizer.step` of each, with `targets[i]` target
    tokens): the gradients' division, the per-job norms and clipping and the AdamW updates each run as one
    multi-tensor operation over every job's parameters (AdamW once per set of equal hyperparameters: lr,
    betas, eps, weight decay), so the operations of a fused step do not grow with its number of jobs.

    Each job's result depends on its own gradients only (every operation is per tensor or per job; a job's
    squared norms are summed in its own order, `chained_sum`), so a job steps the same alone as beside
    others, and on a pipeline trainer whose stages each hold part of its adapter. Against
    `JobOptimizer.step` (torch's clip_grad_norm_): the gradient norm is summed in float64 in another order
    (float32 rounding of the norm and the clip factor; the updates are otherwise AdamW's own kernel).
    A job that cannot join (loss scaling, an unfused optimizer) takes its own `step`.

    `on_device` (CUDA): the norms, the clip factors and the updates stay on the device and nothing is read
    back (`_step_together_on_device`): a joined job's norm comes back as a 0-d float64 tensor, to be read with
    the step's other results once the step is queued. Its norm is then summed in the device's order (not
    `chained_sum`'s), so a pipeline's stages, which sum theirs on the host, agree with it to rounding."""
    results: dict[int, tuple[float, float | torch.Tensor]] = {}
    joined = [index for index, optimizer in enumerate(optimizers) if _batchable(optimizer)]
    for index, optimizer in enumerate(optimizers):
        if index not in joined:
            results[index] = optimizer.step(targets[index])
    joined = [index for index in joined if any(p.grad is not None for p in optimizers[index].parameters)]
    for index in set(range(len(optimizers))) - set(results) - set(joined):   # no gradient at all: norm 0
        optimizer = optimizers[index]
        lr = optimizer.lr
        optimizer.step_count += 1
        optimizer.set_lr()
        results[index] = (lr, 0.0)
    if joined:
        together = _step_together_on_device if on_device else _step_together
        together([optimizers[index] for index in joined], [targets[index] for index in joined], results, joined)
    return [results[index] for index in range(len(optimizers))]


def gradient_squares(optimizers: list[JobOptimizer], targets: list[int]) -> list[list[float]]:
    """Turn each job's summed gradients into their mean over its `targets[i]` target tokens (in place) and
    return, per job, each gradient's squared norm (float64) in parameter order: the first half of a step,
    which a pipeline stage takes on its own share of the adapter. A few multi-tensor operations whatever
    the number of jobs."""
    grads: list[torch.Tensor] = []
    divisors: list[float] = []
    counts: list[int] = []
    for optimizer, count in zip(optimizers, targets, strict=True):
        own = [p.grad for p in optimizer.parameters if p.grad is not None]
        grads.extend(own)
        divisors.extend([optimizer.token_weight * max(count, 1)] * len(own))
        counts.append(len(own))
    if not grads:
        return [[] for _ in optimizers]
    torch._foreach_div_(grads, divisors)
    squares = torch.stack(torch._foreach_norm(grads)).to(torch.float64).square_().tolist()
    out, start = [], 0
    for count in counts:
        out.append(squares[start:start + count])
        start += count
    return out


def chained_sum(squares: list[float], start: float = 0.0) -> float:
    """The squared gradient norm summed one tensor at a time from the adapter's last tensor back to its first,
    continuing from `start`: the same float64 additions in the same order whether one process holds every
    tensor or pipeline stages each add their own share and pass the partial sum on (last stage first)."""
    total = start
    for value in reversed(squares):
        total += value
    return total


def apply_step(optimizers: list[JobOptimizer], norms: list[float]) -> list[tuple[float, float]]:
    """The second half of the jobs' steps, their gradients already divided (`gradient_squares`): clip each
    job's gradients to its max_grad_norm by its total norm `norms[i]`, one fused AdamW per set of equal
    hyperparameters, zero the gradients. Returns (lr used, norm) per job."""
    clipped: list[torch.Tensor] = []
    factors: list[float] = []
    for optimizer, norm in zip(optimizers, norms, strict=True):
        limit = optimizer.spec.max_grad_norm
        if limit is not None:
            own = [p.grad for p in optimizer.parameters if p.grad is not None]
            clipped.extend(own)
            factors.extend([min(limit / (norm + 1e-6), 1.0)] * len(own))
    if clipped:
        torch._foreach_mul_(clipped, factors)
    return _adamw_steps(optimizers, norms)


def _group_lists(optimizer: JobOptimizer, group: dict, lists: tuple[list[torch.Tensor], ...]) -> None:
    """Append a parameter group's (params, grads, moments, steps) to `lists`, as torch's `_init_group` gathers
    them (and lazily makes the state, the first time): once the state exists, the same tensors are kept with the
    group while the same parameters have gradients, and only the gradients are read again (gathered parameter by
    parameter in Python, a job of hundreds of adapter tensors cost a millisecond a step)."""
    params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
    optimizer._leave_flat()
    kept = optimizer.group_lists.get(id(group))
    present = tuple([id(p) for p in group["params"] if p.grad is not None])
    if kept is None or kept[0] != present:
        own: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        optimizer.optimizer._init_group(group, *own)   # torch's own lazy state initialisation
        kept = (present, own[0], own[2], own[3], own[5])
        optimizer.group_lists[id(group)] = kept
    _, own_params, own_avgs, own_avg_sqs, own_steps = kept
    params.extend(own_params)
    grads.extend([p.grad for p in own_params])
    exp_avgs.extend(own_avgs)
    exp_avg_sqs.extend(own_avg_sqs)
    steps.extend(own_steps)


def _adamw_steps(optimizers: list[JobOptimizer], norms: list) -> list[tuple[float, float | torch.Tensor]]:
    """One fused AdamW per set of equal hyperparameters over the jobs' (divided, clipped) gradients, then zero
    them and advance the schedules. Returns (lr used, norm) per job."""
    by_hyperparameters: dict[tuple, list[tuple[JobOptimizer, dict]]] = {}
    lrs = [optimizer.lr for optimizer in optimizers]
    for optimizer in optimizers:
        for group in optimizer.optimizer.param_groups:   # LoRA+: two groups, at two learning rates
            key = (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"],
                   group["decoupled_weight_decay"])
            by_hyperparameters.setdefault(key, []).append((optimizer, group))
    for (lr, (beta1, beta2), eps, weight_decay, decoupled), members in by_hyperparameters.items():
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        for optimizer, group in members:
            _group_lists(optimizer, group, lists)
        params, step_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = lists
        if params:
            functional_adam(params, step_grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                            fused=True, decoupled_weight_decay=decoupled, amsgrad=False, beta1=beta1,
                            beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    return _advance(optimizers, lrs, norms)


def _advance(optimizers: list[JobOptimizer], lrs: list[float], norms: list) -> list[tuple[float, float | torch.Tensor]]:
    """After the jobs' updates: their gradients dropped, step counts and schedules advanced; (lr used, norm)
    per job."""
    for optimizer in optimizers:
        for parameter in optimizer.parameters:
            parameter.grad = None
        optimizer.step_count += 1
        optimizer.set_lr()
    return list(zip(lrs, norms, strict=True))


def _step_together_on_device(optimizers: list[JobOptimizer], targets: list[int],
                             results: dict[int, tuple[float, float | torch.Tensor]], indices: list[int]) -> None:
    """`_step_together` without reading anything back: the jobs whose adapter is pooled with its gradients
    attached (every job on the CUDA path) by `_step_flat`, the others by `_step_unpooled_on_device`."""
    flats = [_flat_ready(optimizer) for optimizer in optimizers]
    for chosen, step in (([p for p, flat in enumerate(flats) if flat is not None], _step_flat),
                         ([p for p, flat in enumerate(flats) if flat is None], _step_unpooled_on_device)):
        if chosen:
            step([optimizers[p] for p in chosen], [targets[p] for p in chosen], results, [indices[p] for p in chosen])


def _flat_ready(optimizer: JobOptimizer) -> FlatAdamW | None:
    """The job's flat step where it can take this one: its gradients are its pool's buffer, its state the flat
    moments (adopted now where torch's AdamW held them)."""
    flat = optimizer.flat
    if flat is None or not flat.pool.attached() or not flat.ensure_state():
        return None
    return flat


_ONES: dict[torch.device, torch.Tensor] = {}


def _step_flat(optimizers: list[JobOptimizer], targets: list[int],
               results: dict[int, tuple[float, float | torch.Tensor]], indices: list[int]) -> None:
    """Each job's gradient norm over its pool's buffer (one multi-tensor reduction for every job), its clip factor
    min(limit / (norm + 1e-6), 1) on the device (a few multi-tensor operations for every job), then per job one
    kernel: the AdamW update of its whole adapter with the gradients times factor / targets
    (`FlatAdamW.update`). The norm is the gradients' mean's, as `_step_together_on_device` reports it."""
    flats = [optimizer.flat for optimizer in optimizers]
    lrs = [optimizer.lr for optimizer in optimizers]
    divisors = [optimizer.token_weight * max(count, 1) for optimizer, count in zip(optimizers, targets, strict=True)]
    norms = torch._foreach_div(torch._foreach_norm([flat.pool.grad_flat for flat in flats]), divisors)
    device = flats[0].pool.flat.device
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    factors = [one] * len(flats)
    clipped = [p for p, optimizer in enumerate(optimizers) if optimizer.spec.max_grad_norm is not None]
    if clipped:
        chosen = torch._foreach_add([norms[p] for p in clipped], 1e-6)
        torch._foreach_reciprocal_(chosen)
        torch._foreach_mul_(chosen, [float(optimizers[p].spec.max_grad_norm) for p in clipped])
        torch._foreach_clamp_max_(chosen, 1.0)
        for p, factor in zip(clipped, chosen, strict=True):
            factors[p] = factor
    for flat, factor, divisor in zip(flats, factors, divisors, strict=True):
        flat.update(factor, divisor)
    for index, result in zip(indices, _advance(optimizers, lrs, norms), strict=True):
        results[index] = result


def _step_unpooled_on_device(optimizers: list[JobOptimizer], targets: list[int],
                             results: dict[int, tuple[float, float | torch.Tensor]], indices: list[int]) -> None:
    """`_step_together` without reading anything back: each job's gradients divided by its target count, its
    norm summed on the device (float64), its clip factor min(limit / (norm + 1e-6), 1) a device scalar that
    multiplies its gradients, then the AdamW steps. A few operations per job (its norm, its factor), the
    division and the updates multi-tensor over every job."""
    grads: list[torch.Tensor] = []
    divisors: list[float] = []
    owned: list[list[torch.Tensor]] = []
    for optimizer, count in zip(optimizers, targets, strict=True):
        own = [p.grad for p in optimizer.parameters if p.grad is not None]
        grads.extend(own)
        owned.append(own)
        divisors.extend([optimizer.token_weight * max(count, 1)] * len(own))
    torch._foreach_div_(grads, divisors)
    squares = torch.stack(torch._foreach_norm(grads)).to(torch.float64).square_()
    norms: list[torch.Tensor] = []
    start = 0
    for optimizer, own in zip(optimizers, owned, strict=True):
        norm = squares[start:start + len(own)].sum().sqrt()
        start += len(own)
        norms.append(norm)
        limit = optimizer.spec.max_grad_norm
        if limit is not None:
            factor = torch.reciprocal(norm + 1e-6).mul_(limit).clamp_(max=1.0).to(torch.float32)
            torch._foreach_mul_(own, factor)
    for position, outcome in enumerate(_adamw_steps(optimizers, norms)):
        results[indices[position]] = outcome


def _step_together(optimizers: list[JobOptimizer], targets: list[int], results: dict[int, tuple[float, float]],
                   indices: list[int]) -> None:
    norms = [math.sqrt(chained_sum(squares)) for squares in gradient_squares(optimizers, targets)]
    for position, outcome in enumerate(apply_step(optimizers, norms)):
        results[indices[position]] = outcome
