"""One job's AdamW step over its pooled adapter in a single pass (the CUDA path's optimizer step).

A job's plain adapters are one flat float32 tensor (`adapter_surgery.pool_masters`: every A, then every B) and their
gradients one flat buffer (`lora_masters.MasterPool`). torch's fused AdamW steps them as hundreds of small tensors
at about half the card's memory bandwidth (the 2026-11-28 H200 profile: 0.45 of HBM), and the step around it read
and wrote every gradient three more times (divided by the target count, its norm, clipped) before the compute-dtype
cast read the masters again and the next backward zeroed the buffer. On the 8B shape at 32 adapters that was 38 ms
of a 0.27 s step (bench/gpu_cost_model.py --fusion).

Here, per job: the gradient's norm (one reduction over the buffer), its clip factor on the device, then one kernel
that reads gradient, master and moments once and writes master, moments, the compute-dtype copy (B times the
job's scaling, as `MasterPool.refresh` makes it) and a zeroed gradient. The kernel is Triton's
(`_adamw_kernel`, checked once per device against its reference: `kernel_works`); `reference_update` is the same
arithmetic in torch, readable, for a device without Triton (or where the kernel failed its check) and for the tests
(tests/unit/engine/test_flat_adamw.py against torch's AdamW; the kernel under Triton's interpreter in
tests/unit/engine/test_engine_kernels_interpreted.py).

The arithmetic is torch's AdamW (decoupled weight decay, bias corrections): p <- p (1 - lr wd); m <- b1 m + (1 - b1) g;
v <- b2 v + (1 - b2) g^2; p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), with g the gradient
times the job's factor (clip / target tokens). LoRA+: the A region and the B region take their own learning rates.

torch's optimizer keeps its per-parameter state as views of this module's flat moments, so its state_dict, a
checkpoint and the memory counts read them as before; each parameter's `step` tensor is brought up to date when the
state is read (`sync_steps`), not every step (hundreds of tensors a job)."""

from __future__ import annotations

import math

import torch
from torch import nn

from actors.engine.lora_masters import MasterPool, pool_of
from actors.engine.triton_support import KernelCheck, tl, triton, triton_runs

BLOCK = 2048
GROUPED_KEYS = ("betas", "eps", "weight_decay")


def reference_update(pool: MasterPool, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, factor: torch.Tensor,
                     hyper: StepHyper, cast: torch.Tensor | None) -> None:
    """The kernel's arithmetic in torch operations, region by region (A, then B), in float32."""
    with torch.no_grad():
        for region, lr, copy_scale in ((slice(0, pool.b_region), hyper.lr_a, 1.0),
                                       (slice(pool.b_region, None), hyper.lr_b, pool.scaling)):
            param, grad = pool.flat[region], pool.grads.values[region]
            m, v = exp_avg[region], exp_avg_sq[region]
            g = grad * (factor * hyper.inverse_targets)
            param.mul_(1.0 - lr * hyper.weight_decay)
            m.mul_(hyper.beta1).add_(g, alpha=1.0 - hyper.beta1)
            v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
            denom = v.sqrt().div_(hyper.bias2_sqrt).add_(hyper.eps)
            param.addcdiv_(m, denom, value=-lr / hyper.bias1)
            grad.zero_()
            if cast is not None:
                cast[region].copy_(param * copy_scale if copy_scale != 1.0 else param)


if triton is not None:
    @triton.jit
    def _adamw_kernel(param, grad, exp_avg, exp_avg_sq, cast, factor, n, b_start, decay_a, decay_b, step_size_a,
                      step_size_b, inverse_targets, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bias2_sqrt,
                      scaling, HAS_CAST: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        # every scalar comes computed in double on the host and rounded once (`StepHyper`), as torch's AdamW has
        # them: a compiled kernel takes its scalars in float32, where 1 - beta2 from a rounded beta2 is 1.3e-5 off
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        inside = offsets < n
        in_b = offsets >= b_start
        g = tl.load(grad + offsets, mask=inside, other=0.0) * (tl.load(factor) * inverse_targets)
        p = tl.load(param + offsets, mask=inside, other=0.0)
        m = tl.load(exp_avg + offsets, mask=inside, other=0.0)
        v = tl.load(exp_avg_sq + offsets, mask=inside, other=0.0)
        p = p * tl.where(in_b, decay_b, decay_a)
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        # IEEE-rounded square root and divisions, as torch's: on CUDA Triton's tl.sqrt and `/` are the approximate
        # instructions (sqrt.approx, div.full: 2 units in the last place), which the interpreter's numpy never shows
        denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
        p = p - tl.where(in_b, step_size_b, step_size_a) * tl.div_rn(m, denom)
        tl.store(param + offsets, p, mask=inside)
        tl.store(exp_avg + offsets, m, mask=inside)
        tl.store(exp_avg_sq + offsets, v, mask=inside)
        tl.store(grad + offsets, tl.zeros_like(g), mask=inside)
        if HAS_CAST:
            copy = tl.where(in_b, p * scaling, p)
            tl.store(cast + offsets, copy.to(cast.dtype.element_ty), mask=inside)

    # what the GPU cost model's recorder counts twice (read, then written): the tensors updated in place
    _adamw_kernel.read_and_written = ("param", "grad", "exp_avg", "exp_avg_sq")


class StepHyper:
    """One job's AdamW settings for one step, as plain floats (the kernel's scalar arguments), each derived in
    double precision here as torch's AdamW derives them (1 - lr·wd, lr / (1 - b1^t), 1 - b1, ...)."""

    def __init__(self, *, lr_a: float, lr_b: float, weight_decay: float, betas: tuple[float, float], eps: float,
                 step: int, targets: float):
        self.lr_a, self.lr_b, self.weight_decay, self.eps = float(lr_a), float(lr_b), float(weight_decay), float(eps)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.bias1 = 1.0 - self.beta1 ** step
        self.bias2_sqrt = math.sqrt(1.0 - self.beta2 ** step)
        self.inverse_targets = 1.0 / targets

    def kernel_scalars(self) -> tuple[float, ...]:
        """`_adamw_kernel`'s scalars from decay_a through bias2_sqrt, in its order."""
        return (1.0 - self.lr_a * self.weight_decay, 1.0 - self.lr_b * self.weight_decay, self.lr_a / self.bias1,
                self.lr_b / self.bias1, self.inverse_targets, self.beta1, 1.0 - self.beta1, self.beta2,
                1.0 - self.beta2, self.eps, self.bias2_sqrt)


def kernel_runs(device: torch.device) -> bool:
    """Whether `_adamw_kernel` runs on this device: Triton on CUDA, or its interpreter on a CPU (tests)."""
    return triton_runs(device)


def kernel_works(device: torch.device) -> bool:
    """Whether the kernel runs here (`kernel_runs`) and agrees with `reference_update` on a small pool, checked once
    per device (`CHECK`): a kernel that fails or disagrees is logged once and the reference steps the jobs instead."""
    return kernel_runs(device) and CHECK.works(device)


def _agrees(device: torch.device) -> bool:
    """One step of a 3,000-entry pool by the kernel and by the reference, from the same state: the masters and the
    moments within one step's rounding of each other, the bfloat16 copy within one bfloat16 unit in the last place."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(3000, generator=generator).to(device) for _ in range(4)]
    results = []
    for kernel in (True, False):
        pool = MasterPool(values[0].clone(), 1000, 2.0)
        pool.grads.values = values[1].clone()
        pool.casts[torch.bfloat16] = torch.empty(3000, dtype=torch.bfloat16, device=device)
        exp_avg, exp_avg_sq = values[2].clone() * 0.01, values[3].clone().square() * 0.01
        factor = torch.full((), 0.5, device=device)
        hyper = StepHyper(lr_a=0.01, lr_b=0.02, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, step=3, targets=4.0)
        if kernel:
            _launch(pool, exp_avg, exp_avg_sq, factor, hyper, pool.casts[torch.bfloat16])
        else:
            reference_update(pool, exp_avg, exp_avg_sq, factor, hyper, pool.casts[torch.bfloat16])
        results.append((pool.flat, exp_avg, exp_avg_sq, pool.casts[torch.bfloat16].float(), pool.grads.values))
    (flat, m, v, cast, grad), (flat_r, m_r, v_r, cast_r, _) = results
    rounding = 32 * torch.finfo(torch.float32).eps
    agree = (bool(((flat - flat_r).abs() <= rounding * (flat_r.abs() + 0.02)).all())
             and bool(((m - m_r).abs() <= rounding * float(m_r.abs().max())).all())
             and bool(((v - v_r).abs() <= rounding * float(v_r.abs().max())).all())
             and bool(((cast - cast_r).abs() <= 2.0 ** -7 * cast_r.abs()).all()) and bool((grad == 0).all()))
    return agree


CHECK = KernelCheck("the flat AdamW kernel", "the torch reference steps the jobs", _agrees)


def _launch(pool: MasterPool, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, factor: torch.Tensor,
            hyper: StepHyper, cast: torch.Tensor | None) -> None:
    flat = pool.flat
    count = flat.numel()
    _adamw_kernel[(triton.cdiv(count, BLOCK),)](
        flat, pool.grads.values, exp_avg, exp_avg_sq, cast if cast is not None else flat, factor, count,
        pool.b_region, *hyper.kernel_scalars(), pool.scaling, HAS_CAST=cast is not None, BLOCK_SIZE=BLOCK)


class FlatAdamW:
    """One job's AdamW as flat tensors in its pool's layout: the moments (`exp_avg`, `exp_avg_sq`), the number of
    steps taken, and torch's per-parameter state entries kept as views of them."""

    def __init__(self, optimizer: torch.optim.Optimizer, pool: MasterPool, parameters: list[nn.Parameter]):
        self.optimizer, self.pool, self.parameters = optimizer, pool, parameters
        self.exp_avg: torch.Tensor | None = None
        self.exp_avg_sq: torch.Tensor | None = None
        self.steps = 0
        self.pending = 0   # steps taken here not yet added to the parameters' `step` tensors

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]) -> FlatAdamW | None:
        """The flat step for these parameters, where they are exactly one pool's (a job's plain adapters, no DoRA
        magnitude or VeRA vector beside) in float32, in one parameter group or LoRA+'s two (its As, its Bs) that
        differ only in their learning rate; else None (the job keeps torch's AdamW)."""
        pool = pool_of(parameters)
        if pool is None or pool.flat.dtype != torch.float32 or not pool.flat.is_contiguous():
            return None
        if {id(p) for p in parameters} != {id(p) for p in pool.parameters}:
            return None
        groups = optimizer.param_groups
        if any(group[key] != groups[0][key] for group in groups for key in GROUPED_KEYS):
            return None
        if len(groups) == 2:
            a_ids = {id(p) for p in pool.parameters if p.storage_offset() - pool.flat.storage_offset()
                     < pool.b_region}
            if {id(p) for p in groups[0]["params"]} != a_ids:
                return None
        elif len(groups) != 1:
            return None
        return cls(optimizer, pool, parameters)

    # -- torch's state, as views ----------------------------------------------------------------------------
    def _ours(self) -> bool:
        state = self.optimizer.state
        first, last = self.parameters[0], self.parameters[-1]
        if self.exp_avg is None or first not in state or last not in state:
            return False
        return (state[first].get("exp_avg") is self._view(self.exp_avg, first)
                and state[last].get("exp_avg_sq") is self._view(self.exp_avg_sq, last))

    def _view(self, flat: torch.Tensor, parameter: nn.Parameter) -> torch.Tensor:
        views = self.__dict__.setdefault("_views", {})
        key = (id(flat), id(parameter))
        if key not in views:
            start = parameter.storage_offset() - self.pool.flat.storage_offset()
            views[key] = flat[start:start + parameter.numel()].view(parameter.shape)
        return views[key]

    def ensure_state(self) -> bool:
        """Make the flat moments torch's state (zeros for a job's first step; a loaded state copied in). False
        where the parameters' states disagree on their step count (they then keep torch's AdamW)."""
        if self._ours():
            return True
        state = self.optimizer.state
        held = [state.get(p) for p in self.parameters]
        steps = 0
        if any(held):
            if not all(entry and "exp_avg" in entry and "exp_avg_sq" in entry for entry in held):
                return False
            # one read of every count, where a loaded (or torch-stepped) state is adopted
            counts = set(torch.stack([torch.as_tensor(entry["step"]).float().cpu() for entry in held]).tolist())
            if len(counts) != 1:
                return False
            steps = int(counts.pop())
        flat = self.pool.flat
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
        self.__dict__.pop("_views", None)
        moments = [self._view(self.exp_avg, p) for p in self.parameters]
        squares = [self._view(self.exp_avg_sq, p) for p in self.parameters]
        if any(held):
            with torch.no_grad():
                torch._foreach_copy_(moments + squares, [entry["exp_avg"] for entry in held]
                                     + [entry["exp_avg_sq"] for entry in held])
        for parameter, entry, m, v in zip(self.parameters, held, moments, squares, strict=True):
            # as torch's fused AdamW makes a count: a float32 scalar on the parameter's device
            step = entry["step"] if entry else torch.zeros((), dtype=torch.float32, device=parameter.device)
            state[parameter] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        self.steps, self.pending = steps, 0
        return True

    def release(self) -> None:
        """torch's AdamW steps the job next (its state is these views): the counts brought up to date, the flat
        moments adopted again (with the counts read) at the next flat step."""
        if self.exp_avg is not None:
            self.sync_steps()
            self.exp_avg = self.exp_avg_sq = None
            self.__dict__.pop("_views", None)

    def sync_steps(self) -> None:
        """Add the steps taken here to every parameter's `step` tensor (before torch's state is read or used)."""
        if self.pending:
            steps = [self.optimizer.state[p]["step"] for p in self.parameters]
            torch._foreach_add_(steps, float(self.pending))
            self.pending = 0

    # -- the step -------------------------------------------------------------------------------------------
    def hyper(self, targets: float) -> StepHyper:
        groups = self.optimizer.param_groups
        first = groups[0]
        return StepHyper(lr_a=first["lr"], lr_b=groups[-1]["lr"], weight_decay=first["weight_decay"],
                         betas=first["betas"], eps=first["eps"], step=self.steps + 1, targets=targets)

    def update(self, factor: torch.Tensor, targets: float) -> None:
        """One AdamW step of the job's whole adapter with its gradients times `factor` / `targets` (`factor`: a
        0-d float32 device tensor, the clip factor or 1), the compute-dtype copy refreshed and the gradient
        buffer zeroed, in one kernel where Triton runs (`reference_update` elsewhere)."""
        pool = self.pool
        hyper = self.hyper(targets)
        casts = list(pool.casts.items())
        cast = casts[0][1] if len(casts) == 1 else None   # two compute dtypes at once: refreshed as they were
        flat = pool.flat
        if kernel_works(flat.device):
            _launch(pool, self.exp_avg, self.exp_avg_sq, factor, hyper, cast)
        else:
            reference_update(pool, self.exp_avg, self.exp_avg_sq, factor, hyper, cast)
        # the kernel writes behind autograd's back: count the change, as an in-place operation would
        for written in (flat, self.exp_avg, self.exp_avg_sq, pool.grads.values):
            torch.autograd.graph.increment_version(written)
        pool.stepped(casts[0][0] if cast is not None else None)
        self.steps += 1
        self.pending += 1
