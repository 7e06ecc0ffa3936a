"""Several jobs' optimizer steps taken together (`step_jobs`): each job's gradients divided by its step's
target count, its norm, its clipping and the AdamW updates run as multi-tensor operations over every joining
job's parameters (AdamW once per set of equal hyperparameters), so that the operations of a fused step do not
grow with its number of jobs, while each job steps as it would alone. On CUDA nothing is read back: a job's
pooled adapter takes one kernel (actors/engine/flat_adamw.py), the others' norms stay on the device. The two
halves a pipeline stage takes on its share of the adapters (`gradient_squares`, `apply_step`) and the norm's
summing order (`chained_sum`) are here too. One job's optimizer (`JobOptimizer`): actors/engine/optim.py."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.adam import adam as functional_adam

from actors.engine.flat_adamw import FlatAdamW
from actors.engine.optim import JobOptimizer, batchable


def step_jobs(optimizers: list[JobOptimizer], targets: list[int], *, on_device: bool = False,
              later: list[Callable[[], None]] | None = None) -> list[tuple[float, float | torch.Tensor]]:
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
    `chained_sum`'s), so a pipeline's stages, which sum theirs on the host, agree with it to rounding.

    `later` (with `on_device`): the flat AdamW updates and what follows them (the gradients dropped, step counts
    and schedules advanced) are appended to it as one callable instead of run, for the caller to run once it has
    read the norms back: the read then waits for the backward and the norms, not for the updates, which the device
    runs while the host goes on to the next step (each job's lr and norm are returned as they will be used)."""
    results: dict[int, tuple[float, float | torch.Tensor]] = {}
    joined = [index for index, optimizer in enumerate(optimizers) if batchable(optimizer)]
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
        if on_device:
            _step_together_on_device([optimizers[index] for index in joined], [targets[index] for index in joined],
                                     results, joined, later)
        else:
            _step_together([optimizers[index] for index in joined], [targets[index] for index in joined], results,
                           joined)
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
    optimizer.leave_flat()
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
                             results: dict[int, tuple[float, float | torch.Tensor]], indices: list[int],
                             later: list[Callable[[], None]] | None = None) -> None:
    """`_step_together` without reading anything back: the jobs whose adapter is pooled with its gradients
    attached (every job on the CUDA path) by `_step_flat` (its updates put in `later` where given), the others by
    `_step_unpooled_on_device`."""
    flats = [_flat_ready(optimizer) for optimizer in optimizers]
    flat = [p for p, found in enumerate(flats) if found is not None]
    unpooled = [p for p, found in enumerate(flats) if found is None]
    if flat:
        _step_flat([optimizers[p] for p in flat], [targets[p] for p in flat], results, [indices[p] for p in flat],
                   later)
    if unpooled:
        _step_unpooled_on_device([optimizers[p] for p in unpooled], [targets[p] for p in unpooled], results,
                                 [indices[p] for p in unpooled])


def _flat_ready(optimizer: JobOptimizer) -> FlatAdamW | None:
    """The job's flat step where it can take this one: its gradients are its pool's buffer, its state the flat
    moments (adopted now where torch's AdamW held them)."""
    flat = optimizer.flat
    if flat is None or not flat.pool.grads.attached() or not flat.ensure_state():
        return None
    return flat


_ONES: dict[torch.device, torch.Tensor] = {}


def _step_flat(optimizers: list[JobOptimizer], targets: list[int],
               results: dict[int, tuple[float, float | torch.Tensor]], indices: list[int],
               later: list[Callable[[], None]] | None = None) -> None:
    """Each job's gradient norm over its pool's buffer (one multi-tensor reduction for every job), its clip factor
    min(limit / (norm + 1e-6), 1) on the device (a few multi-tensor operations for every job), then per job one
    kernel: the AdamW update of its whole adapter with the gradients times factor / targets
    (`FlatAdamW.update`). The norm is the gradients' mean's, as `_step_together_on_device` reports it."""
    flats = [optimizer.flat for optimizer in optimizers]
    lrs = [optimizer.lr for optimizer in optimizers]
    divisors = [optimizer.token_weight * max(count, 1) for optimizer, count in zip(optimizers, targets, strict=True)]
    norms = torch._foreach_div(torch._foreach_norm([flat.pool.grads.values for flat in flats]), divisors)
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
    for index, lr, norm in zip(indices, lrs, norms, strict=True):
        results[index] = (lr, norm)

    def update() -> None:
        for flat, factor, divisor in zip(flats, factors, divisors, strict=True):
            flat.update(factor, divisor)
        _advance(optimizers, lrs, norms)

    if later is None:
        update()
    else:
        later.append(update)


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
