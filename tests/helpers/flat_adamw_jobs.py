"""Pooled jobs for the flat AdamW's tests (actors/engine/flat_adamw.py): a job's adapters on two layers pooled as
add_adapter pools them, random gradients added into the pool's buffer as the CUDA path's backward adds them, and the
reference every check is held to: torch's AdamW in float64 over unpooled copies (tests/unit/engine/test_flat_adamw.py
derives the bound)."""

from __future__ import annotations

import math

import torch

from actors.engine.adapter_surgery import pool_masters
from actors.engine.lora_adapter import LoraAdapter
from actors.engine.optim import JobOptimizer
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from tests.helpers.tolerances import ADAMW_ROUNDINGS, unit_roundoff

SHAPES = ((24, 16), (40, 24))   # two layers' (out, in)


def spec(name: str = "a", **overrides) -> JobSpec:
    fields = dict(name=name, data="x", format={"type": "text"}, lr=0.02, lr_schedule="cosine", warmup_steps=1,
                  weight_decay=0.1, max_grad_norm=0.5)
    return JobSpec(**{**fields, **overrides})


def pooled_job(job_spec: JobSpec, seed: int, rank: int = 4, device: str = "cpu"
               ) -> tuple[JobOptimizer, list[LoraAdapter]]:
    """A job's adapters on two layers, pooled as add_adapter pools a job's (one flat tensor), B non-zero."""
    adapters = []
    for index, (out_features, in_features) in enumerate(SHAPES):
        adapter = LoraAdapter(in_features, out_features, LoraConfig(r=rank, alpha=2 * rank),
                              generator=torch.Generator().manual_seed(seed * 10 + index), device=torch.device(device))
        with torch.no_grad():
            adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape,
                                             generator=torch.Generator().manual_seed(seed * 10 + index + 5)))
        adapters.append(adapter)
    pool_masters(adapters, torch.device(device))
    parameters = [p for adapter in adapters for p in (adapter.lora_A, adapter.lora_B)]
    fast = [adapter.lora_B for adapter in adapters] if job_spec.lora.loraplus_lr_ratio else None
    return JobOptimizer(job_spec, parameters, total_steps=6, fast_parameters=fast), adapters


def reference_of(optimizer: JobOptimizer) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    """torch's AdamW in float64 over unpooled copies, LoRA+'s groups as the job's."""
    copies = [torch.nn.Parameter(p.detach().cpu().double()) for p in optimizer.parameters]
    by_id = {id(p): c for p, c in zip(optimizer.parameters, copies, strict=True)}
    groups = [{"params": [by_id[id(p)] for p in group["params"]], "lr_ratio": group["lr_ratio"]}
              for group in optimizer.optimizer.param_groups]
    return copies, torch.optim.AdamW(groups, lr=optimizer.spec.lr, weight_decay=optimizer.spec.weight_decay,
                                     foreach=False)


def add_gradients(optimizer: JobOptimizer, generator: torch.Generator, scale: float = 3.0) -> list[torch.Tensor]:
    """Random gradients added into the job's pooled buffer, as the CUDA path's backward adds them."""
    optimizer.flat.pool.grads.attach()
    grads = [(torch.randn(p.shape, generator=generator) * scale).to(p.device) for p in optimizer.parameters]
    with torch.no_grad():
        for parameter, grad in zip(optimizer.parameters, grads, strict=True):
            parameter.grad.add_(grad)
    return grads


def reference_step(optimizer: JobOptimizer, copies, reference, grads, targets: int) -> float:
    for copy_, grad in zip(copies, grads, strict=True):
        copy_.grad = grad.cpu().double() / targets
    norm = float(torch.nn.utils.clip_grad_norm_(copies, optimizer.spec.max_grad_norm or math.inf))
    for group in reference.param_groups:
        group["lr"] = optimizer.lr * group["lr_ratio"]
    reference.step()
    reference.zero_grad(set_to_none=True)
    return norm


def assert_within_adamw_rounding(optimizer: JobOptimizer, copies, steps: int) -> None:
    lr = optimizer.spec.lr * max(group["lr_ratio"] for group in optimizer.optimizer.param_groups)
    for parameter, expected in zip(optimizer.parameters, copies, strict=True):
        bound = 2 * steps * ADAMW_ROUNDINGS * unit_roundoff() * (expected.detach().abs() + lr)
        error = (parameter.detach().cpu().double() - expected.detach()).abs()
        assert bool((error <= bound).all()), float((error - bound).max())
