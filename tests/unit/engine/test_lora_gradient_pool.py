"""The CUDA LoRA path's pooled gradients (actors/engine/lora_masters.py): a pooled job's gradients are added into
one flat buffer whose views are its parameters' `.grad`, without an autograd node per parameter. Checked on the
CPU (the path run there in bfloat16, `COMPUTE = "base"`) against the same adapters left unpooled, whose gradients
autograd accumulates as before: bit for bit, over one and two backward passes, after the gradients were cleared,
for frozen adapters, and for the kept per-layer lookups when adapters come and go."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.engine import lora_cuda
from actors.engine.adapter_surgery import fused_layers, pool_masters, set_adapters_training
from actors.engine.layout import step_layout
from actors.engine.lora_grad_kernel import GroupTargets
from actors.engine.lora_masters import pool_of
from tests.helpers.lora_bounds import BOUNDS, IN, OUT, RANKS, bf16_values, fused_layer, layout_of


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")


def _pair(ranks=RANKS):
    """Two copies of one three-job layer: the first's adapters pooled (one pool per job, as add_adapter pools a
    job's), the second's left as separate parameters."""
    unpooled = fused_layer(ranks=ranks)
    pooled = copy.deepcopy(unpooled)
    for adapter in pooled.adapters.values():
        pool_masters([adapter], torch.device("cpu"))
    return pooled, unpooled


def _backward(layer, x, upstream, layout):
    """The layer's output and backward on an input that needs no gradient (as a first layer's: the anchor
    makes the backward run)."""
    with step_layout(layout):
        out = layer(x)
    (out.float() * upstream.float()).sum().backward()
    return out


def _grads(layer):
    return {name: (a.lora_A.grad, a.lora_B.grad) for name, a in layer.adapters.items()}


@pytest.mark.parametrize("kernel,ranks", [("segments", RANKS), ("grouped_mm", RANKS), ("grouped_mm", (8, 8, 8))],
                         ids=["segments", "grouped_mm-padded", "grouped_mm-stacked"])
def test_pooled_gradients_equal_autograds_bit_for_bit_and_accumulate(monkeypatch, kernel, ranks):
    """With ranks of the stack's (8, 8, 8), grouped_mm's stacked gradients go into the buffers by themselves
    (actors/engine/lora_grad_kernel.py, its torch way on this CPU); padded ranks take the list."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    stacked = []
    real_add = GroupTargets.add
    monkeypatch.setattr(GroupTargets, "add", lambda self, *a: stacked.append(1) or real_add(self, *a))
    pooled, unpooled = _pair(ranks)
    first = (bf16_values(1, 57, IN), bf16_values(1, 57, OUT))
    second = (bf16_values(1, 30, IN), bf16_values(1, 30, OUT))
    second_layout = layout_of(((0, 9), (9, 30)), ["job2", "job0"])   # another step: other jobs, other order
    for layer in (pooled, unpooled):
        _backward(layer, *first, layout_of())
    for (name, (a, b)), (_, (ref_a, ref_b)) in zip(_grads(pooled).items(), _grads(unpooled).items(), strict=True):
        assert torch.equal(a, ref_a) and torch.equal(b, ref_b), name
        pool = pooled.adapters[name].master_pool[0]
        assert a.data_ptr() >= pool.grads.values.data_ptr()   # a view of the job's buffer
        assert a.untyped_storage().data_ptr() == pool.grads.values.untyped_storage().data_ptr()
    for layer in (pooled, unpooled):   # a second micro-batch of the same optimizer step: the gradients add up
        _backward(layer, *second, second_layout)
    for (name, (a, b)), (_, (ref_a, ref_b)) in zip(_grads(pooled).items(), _grads(unpooled).items(), strict=True):
        assert torch.equal(a, ref_a) and torch.equal(b, ref_b), name
    assert len(stacked) == (2 if ranks == (8, 8, 8) else 0)


def test_cleared_gradients_start_from_zero_and_a_job_outside_the_step_keeps_none():
    pooled, unpooled = _pair()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    for layer in (pooled, unpooled):
        _backward(layer, x, upstream, layout_of())
        for adapter in layer.adapters.values():   # as the optimizers clear them after a step
            adapter.lora_A.grad = adapter.lora_B.grad = None
    layout = layout_of(((0, 20), (20, 57)), ["job0", "job2"])
    for layer in (pooled, unpooled):
        _backward(layer, x, upstream, layout)
    assert pooled.adapters["job1"].lora_A.grad is None and pooled.adapters["job1"].lora_B.grad is None
    for name in ("job0", "job2"):
        assert torch.equal(pooled.adapters[name].lora_A.grad, unpooled.adapters[name].lora_A.grad)
        assert torch.equal(pooled.adapters[name].lora_B.grad, unpooled.adapters[name].lora_B.grad)


def test_a_gradient_held_from_elsewhere_is_kept_when_the_buffer_is_attached():
    """A gradient that autograd (or a load) left on a pooled parameter is carried into the buffer, not lost."""
    pooled, unpooled = _pair()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    for layer in (pooled, unpooled):
        for index, adapter in enumerate(layer.adapters.values()):
            adapter.lora_B.grad = torch.full_like(adapter.lora_B, float(index + 1))
        _backward(layer, x, upstream, layout_of())
    for (name, (a, b)), (_, (ref_a, ref_b)) in zip(_grads(pooled).items(), _grads(unpooled).items(), strict=True):
        assert torch.equal(b, ref_b) and torch.equal(a, ref_a), name


def test_frozen_adapters_get_no_gradient_and_no_grad_mode_records_nothing():
    pooled, _ = _pair()
    for adapter in pooled.adapters.values():
        adapter.requires_grad_(False)
    x = bf16_values(1, 57, IN).requires_grad_(True)
    with step_layout(layout_of()):
        out = pooled(x)
    out.float().sum().backward()
    assert all(a.lora_A.grad is None and a.lora_B.grad is None for a in pooled.adapters.values())
    assert x.grad is not None
    for adapter in pooled.adapters.values():
        adapter.requires_grad_(True)
    with torch.no_grad(), step_layout(layout_of()):
        assert not pooled(bf16_values(1, 57, IN)).requires_grad


@pytest.mark.parametrize("kernel,ranks", [("segments", RANKS), ("grouped_mm", RANKS), ("grouped_mm", (8, 8, 8))],
                         ids=["segments", "grouped_mm-padded", "grouped_mm-stacked"])
def test_a_nan_in_one_jobs_tokens_reaches_no_other_jobs_pooled_gradient(monkeypatch, kernel, ranks):
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    pooled, _ = _pair(ranks)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    start, end = BOUNDS[1]
    x[0, start + 3] = float("nan")
    _backward(pooled, x, upstream, layout_of())
    grads = _grads(pooled)
    assert not torch.isfinite(grads["job1"][0]).all()
    for name in ("job0", "job2"):
        assert all(torch.isfinite(g).all() for g in grads[name]), name


def test_the_kept_lookups_follow_adapters_added_removed_and_the_mode():
    """The layer keeps which of the step's jobs it adapts between steps: an adapter removed or added, or the mode
    changed, is seen at the next call (outputs against a fresh layer with the same adapters)."""
    layer = fused_layer()
    x = bf16_values(1, 57, IN)
    with torch.no_grad(), step_layout(layout_of()):
        layer(x)
        removed = layer.adapters["job1"]
        del layer.adapters["job1"]
        without = layer(x)
        fresh = copy.deepcopy(layer)
        fresh._present = None
        assert torch.equal(without, fresh(x))
        layer.adapters["job1"] = removed
        assert torch.equal(layer(x), copy.deepcopy(layer)(x))
    model = torch.nn.Sequential(layer)
    set_adapters_training(model, False)
    assert fused_layers(model) == [layer]
    assert not any(adapter.training for adapter in layer.adapters.values())
    added = copy.deepcopy(removed)
    layer.adapters["job3"] = added   # joins in its layer's mode
    assert not added.training
    set_adapters_training(model, True)
    assert all(adapter.training for adapter in layer.adapters.values())


@pytest.mark.parametrize("kernel", ["segments", "grouped_mm"])
def test_a_deep_copy_of_a_pooled_layer_trains_as_its_unpooled_copy_and_leaves_the_original_alone(monkeypatch, kernel):
    """`copy.deepcopy` of a layer whose adapters are pooled, after a backward filled what the layer and its pools
    keep between steps: the copy's parameters are views of its own pool (a parameter's deep copy alone is a clone),
    its gradients equal those of the unpooled layer's copy bit for bit, and the original's gradients stay as they
    were."""
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    pooled, unpooled = _pair((8, 8, 8))
    first = (bf16_values(1, 57, IN), bf16_values(1, 57, OUT))
    for layer in (pooled, unpooled):
        _backward(layer, *first, layout_of())
    before = {name: (a.clone(), b.clone()) for name, (a, b) in _grads(pooled).items()}
    copied, reference = copy.deepcopy(pooled), copy.deepcopy(unpooled)
    for name, adapter in copied.adapters.items():
        pool = adapter.master_pool[0]
        assert pool is not pooled.adapters[name].master_pool[0]
        assert pool_of(pool.parameters) is pool and any(p is adapter.lora_A for p in pool.parameters)
        for parameter in (adapter.lora_A, adapter.lora_B):
            assert parameter.untyped_storage().data_ptr() == pool.flat.untyped_storage().data_ptr()
            assert parameter.grad is None   # as torch copies a parameter
    second = (bf16_values(1, 30, IN), bf16_values(1, 30, OUT))
    layout = layout_of(((0, 9), (9, 30)), ["job2", "job0"])
    for layer in (copied, reference):
        _backward(layer, *second, layout)
    for (name, (a, b)), (_, (ref_a, ref_b)) in zip(_grads(copied).items(), _grads(reference).items(), strict=True):
        assert (a is None) == (ref_a is None) and (b is None) == (ref_b is None), name
        if a is not None:
            assert torch.equal(a, ref_a) and torch.equal(b, ref_b), name
    for name, (a, b) in _grads(pooled).items():
        assert torch.equal(a, before[name][0]) and torch.equal(b, before[name][1]), name
