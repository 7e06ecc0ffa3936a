"""Adapted layers reading one input computed together on the CUDA LoRA path (actors/engine/lora_siblings.py), on the
CPU in bfloat16: q, k and v of three jobs against the exact arithmetic within bfloat16's bounds
(tests/unit/engine/test_lora_cuda_layer.py derives each layer's; the input gradient sums the layers' in one more
rounding per layer, each at most u times the sum of magnitudes that a layer's own bound exceeds by 2u: twice the sum
of the layers' bounds holds it); their outputs bit for bit those of the layers computed one by one (the same
products), with fewer launches; a NaN in one job's rows reaching no other job; the layers that do not fit computed
alone; the whole engine with it on, each job ending as it does alone."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from actors.engine import lora_cuda, lora_grouped_mm, lora_siblings
from actors.engine.adapter_surgery import _link_siblings, pool_masters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.layout import step_layout
from actors.engine.lora_adapter import LoraAdapter
from actors.spec.lora_config import LoraConfig
from tests.helpers.lora_bounds import BOUNDS, IN, SCALINGS, assert_within, bf16_values, exact, layout_of

OUTS = {"q_proj": 40, "k_proj": 16, "v_proj": 16}
RANK = 8


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")


def attention(dropout_in: str | None = None) -> nn.Module:
    """q, k and v of three jobs (rank 8, the jobs' scalings), each job's adapters pooled across the three."""
    torch.manual_seed(0)
    parent = nn.Module()
    per_job: list[list[LoraAdapter]] = [[] for _ in SCALINGS]
    for name, out in OUTS.items():
        layer = FusedLoraLinear(nn.Linear(IN, out, bias=False).to(torch.bfloat16).requires_grad_(False))
        for index, scaling in enumerate(SCALINGS):
            dropout = 0.3 if name == dropout_in and index == 1 else 0.0
            adapter = LoraAdapter(IN, out, LoraConfig(r=RANK, alpha=RANK * scaling, dropout=dropout),
                                  generator=torch.Generator().manual_seed(index), device=torch.device("cpu"))
            with torch.no_grad():
                adapter.lora_B.normal_()
            layer.adapters[f"job{index}"] = adapter
            per_job[index].append(adapter)
        setattr(parent, name, layer)
    for adapters in per_job:
        pool_masters(adapters, torch.device("cpu"))
    _link_siblings(parent)
    return parent


def run(parent: nn.Module, x: torch.Tensor, upstream: dict[str, torch.Tensor], inputs: dict | None = None):
    """Each layer's output on `x` (or `inputs[name]`), called in order as an attention module calls them, and the
    gradients of sum(out * upstream): (outputs, x's gradient, each layer's adapters' (A, B) gradients)."""
    for layer in parent.children():
        for adapter in layer.adapters.values():
            adapter.lora_A.grad = adapter.lora_B.grad = None
    x = x.detach().clone().requires_grad_(True)
    with step_layout(layout_of()):
        outs = {name: getattr(parent, name)((inputs or {}).get(name, x)) for name in OUTS}
    sum((outs[name].float() * upstream[name].float()).sum() for name in OUTS).backward()
    grads = {name: [(a.lora_A.grad.clone(), a.lora_B.grad.clone()) for a in getattr(parent, name).adapters.values()]
             for name in OUTS}
    return outs, x.grad, grads


def counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return bf16_values(1, 57, IN), {name: bf16_values(1, 57, out) for name, out in OUTS.items()}


def test_within_the_bounds_of_the_exact_arithmetic_in_fewer_launches(monkeypatch):
    calls = counted(monkeypatch)
    parent = attention()
    x, upstream = inputs()
    outs, grad_x, grads = run(parent, x, upstream)
    assert len(calls) == 1 + 3 + 4   # the shared down projection, 3 up projections; 4 grouped products backward
    grad_x_exact = grad_x_bound = 0
    for name in OUTS:
        expected, out_bound, layer_grad_x, layer_bound, exact_grads, bounds = exact(getattr(parent, name), x,
                                                                                   upstream[name])
        assert_within(outs[name][0], expected, out_bound, f"{name}'s output")
        for (grad_a, grad_b), (want_a, want_b), (bound_a, bound_b) in zip(grads[name], exact_grads, bounds,
                                                                           strict=True):
            assert_within(grad_a, want_a, bound_a, f"{name}'s A gradient")
            assert_within(grad_b, want_b, bound_b, f"{name}'s B gradient")
        grad_x_exact, grad_x_bound = grad_x_exact + layer_grad_x, grad_x_bound + layer_bound
    assert_within(grad_x[0], grad_x_exact, 2 * grad_x_bound, "input gradient")


def test_outputs_are_those_of_the_layers_one_by_one(monkeypatch):
    x, upstream = inputs()
    together = run(attention(), x, upstream)
    calls = counted(monkeypatch)
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "off")
    alone = run(attention(), x, upstream)
    assert len(calls) == 3 * (2 + 4)
    for name in OUTS:
        assert torch.equal(together[0][name], alone[0][name]), name


def test_a_nan_in_one_jobs_rows_reaches_no_other_job():
    x, upstream = inputs()
    clean = run(attention(), x, upstream)
    start, end = BOUNDS[1]
    x[0, start + 3, 5] = float("nan")
    poisoned = run(attention(), x, upstream)
    for name in OUTS:
        for job in (0, 2):
            assert all(torch.equal(mine, theirs) for mine, theirs in zip(poisoned[2][name][job], clean[2][name][job],
                                                                         strict=True)), (name, job)
        rows = torch.cat([torch.arange(*BOUNDS[0]), torch.arange(*BOUNDS[2])])
        assert torch.equal(poisoned[0][name][0, rows], clean[0][name][0, rows]), name
    assert bool(poisoned[2]["q_proj"][1][0].isnan().any())


def test_a_layer_called_with_another_input_or_with_dropout_is_computed_alone(monkeypatch):
    x, upstream = inputs()
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "off")
    alone = run(attention(), x, upstream, {"k_proj": x.clone()})
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    calls = counted(monkeypatch)
    other_input = run(attention(), x, upstream, {"k_proj": x.clone()})
    # all three computed for x; k again, alone, on its own input (which needs no gradient: 3 products backward)
    assert len(calls) == (1 + 3 + 4) + (2 + 3)
    for name in OUTS:
        assert torch.equal(other_input[0][name], alone[0][name]), name
    calls.clear()
    parent = attention(dropout_in="v_proj")
    torch.manual_seed(2)
    run(parent, x, upstream)
    # q and k together (1 + 2 forward, 4 backward); v's plain jobs on grouped_mm (2 + 4), its dropout job per segment
    assert len(calls) == (1 + 2 + 4) + (2 + 4)


def test_auto_takes_it_on_cuda_only_and_a_failing_kernel_check_keeps_the_layers_alone(monkeypatch, caplog):
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "auto")
    calls = counted(monkeypatch)
    x, upstream = inputs()
    run(attention(), x, upstream)
    assert len(calls) == 3 * (2 + 4)   # on this CPU: each layer alone
    monkeypatch.setattr(lora_siblings, "_CHECKED", {})
    monkeypatch.setattr(lora_grouped_mm, "GROUPED_MM_VERIFIED", True)
    assert lora_siblings.views_work(torch.device("cpu"))
    monkeypatch.setattr(lora_siblings, "_CHECKED", {})
    real = torch._grouped_mm

    def refusing_views(left, right, offs=None):
        if not left.is_contiguous():
            raise RuntimeError("strides should be multiple of 16 bytes")
        return real(left, right, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", refusing_views)
    with caplog.at_level(logging.WARNING):
        assert not lora_siblings.views_work(torch.device("cpu"))
    assert any("does not take views" in record.getMessage() and "multiple of 16" in record.getMessage()
               for record in caplog.records)


def test_the_engine_with_it_on_ends_each_job_as_alone(monkeypatch):
    """Jobs of one rank on every layer (so that the stacks' layout is the same fused and alone), one of them joining
    later and one accumulating, through the whole engine on grouped_mm with the layers together: each ends bit for bit
    as it does alone, and the layers were computed together."""
    from tests.helpers.cuda_path_runs import PlannedJob, assert_as_alone, on_the_cuda_path, run_planned
    from tests.helpers.fused import job_spec
    from tests.helpers.isolation import VOCAB, base_for
    from tests.helpers.models import random_examples

    on_the_cuda_path(monkeypatch, "grouped_mm")
    together = []
    real = lora_siblings._SiblingLinears.apply
    monkeypatch.setattr(lora_siblings._SiblingLinears, "apply", lambda *a: together.append(1) or real(*a))
    base = base_for("bfloat16")
    planned = [PlannedJob(job_spec(name, batch_size=2, grad_accum=accumulate, max_steps=3, lr=1e-2, warmup_steps=1,
                                   lora={"r": 8, "alpha": alpha, "target_modules": "all-linear"}),
                          random_examples(seed, count=12, vocab=VOCAB, min_len=5, max_len=30), seed, joins)
               for name, accumulate, alpha, seed, joins in (("first", 1, 16, 0, 0), ("accumulating", 2, 8, 1, 0),
                                                            ("late", 1, 32, 2, 1))]
    weights, losses, _ = run_planned(base, planned)
    assert together
    assert_as_alone(base, planned, weights, losses)
