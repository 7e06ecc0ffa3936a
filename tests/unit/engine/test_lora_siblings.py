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

from actors.engine import lora_cuda, lora_grouped_mm, lora_siblings
from tests.helpers.lora_bounds import BOUNDS
from tests.helpers.sibling_layers import OUTS, assert_within_the_bounds, attention, counted, inputs, run


@pytest.fixture(autouse=True)
def _on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")


def test_within_the_bounds_of_the_exact_arithmetic_in_fewer_launches(monkeypatch):
    calls = counted(monkeypatch)
    x, upstream = inputs()
    assert_within_the_bounds(attention(), x, upstream)
    # the shared down projection, one up projection by the diagonal stack of Bs; 4 grouped products backward
    assert len(calls) == 1 + 1 + 4


def test_outputs_are_those_of_the_layers_one_by_one(monkeypatch):
    x, upstream = inputs()
    together = run(attention(), x, upstream)
    calls = counted(monkeypatch)
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "off")
    alone = run(attention(), x, upstream)
    assert len(calls) == 3 * (2 + 4)
    for name in OUTS:
        assert torch.equal(together[0][name], alone[0][name]), name


def test_the_frozen_weights_become_rows_of_one_tensor_holding_the_same_numbers_and_bytes():
    """Once all three join, their weights are views of one stacked tensor: the same values, the model's bytes the same
    (each storage once), one base product; a weight replaced afterwards is stacked again and followed."""
    from actors.engine.memory import model_bytes

    parent = attention()
    before = {name: getattr(parent, name).base.weight.detach().clone() for name in OUTS}
    bytes_before = model_bytes(parent)
    x, upstream = inputs()
    run(parent, x, upstream)
    weights = [getattr(parent, name).base.weight for name in OUTS]
    storage = weights[0].untyped_storage().data_ptr()
    assert all(weight.untyped_storage().data_ptr() == storage for weight in weights)
    assert [weight.storage_offset() for weight in weights] == [0, OUTS["q_proj"] * weights[0].shape[1],
                                                               (OUTS["q_proj"] + OUTS["k_proj"]) * weights[0].shape[1]]
    assert all(torch.equal(getattr(parent, name).base.weight, before[name]) for name in OUTS)
    assert model_bytes(parent) == bytes_before
    assert not any(weight.requires_grad for weight in weights)
    from actors.engine.adapter_surgery import _link_siblings

    stacked = parent.q_proj.siblings.stacked.weight
    _link_siblings(parent)   # the set made anew (its layers wrapped again): the weights found stacked, not copied
    run(parent, x, upstream)
    assert parent.q_proj.siblings.stacked.weight.data_ptr() == stacked.data_ptr()
    assert all(getattr(parent, name).base.weight is weight for name, weight in zip(OUTS, weights, strict=True))
    replaced = torch.nn.Parameter(before["k_proj"] * 2, requires_grad=False)
    parent.k_proj.base.weight = replaced
    outs, _, _ = run(parent, x, upstream)
    assert parent.k_proj.base.weight is not replaced   # stacked again, with the new numbers
    assert torch.equal(parent.k_proj.base.weight, before["k_proj"] * 2)
    assert parent.k_proj.base.weight.untyped_storage().data_ptr() == parent.q_proj.base.weight.untyped_storage(
    ).data_ptr()
    lora_siblings.SIBLINGS = "off"
    try:
        alone = run(parent, x, upstream)[0]
    finally:
        lora_siblings.SIBLINGS = "on"
    assert torch.equal(outs["k_proj"], alone["k_proj"])


def test_no_room_to_stack_the_weights_computes_the_layers_one_by_one_and_says_so(monkeypatch, caplog):
    """The stack is made beside the weights it replaces: where the device has no room for it (out of memory), the
    layers are computed one by one, the same outputs, the weights untouched, a warning says what to do, and the
    stacking is not tried again every step."""
    from actors.engine import sibling_weights

    x, upstream = inputs()
    alone = run(attention(), x, upstream)[0]
    tries = []

    def no_room(*args, **kwargs):
        tries.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 235.00 MiB")

    monkeypatch.setattr(sibling_weights, "_rows_of_one", no_room)
    parent = attention()
    with caplog.at_level(logging.WARNING):
        outs = run(parent, x, upstream)[0]
        run(parent, x, upstream)
    assert tries == [1]
    assert any("no room" in record.getMessage() and "smaller memory budget" in record.getMessage()
               for record in caplog.records)
    weights = [getattr(parent, name).base.weight for name in OUTS]
    assert len({weight.untyped_storage().data_ptr() for weight in weights}) == 3
    for name in OUTS:
        assert torch.equal(outs[name], alone[name]), name


def test_biased_layers_stack_their_biases_too_and_compute_what_they_compute_one_by_one(monkeypatch):
    """Qwen2's q, k and v have biases: theirs are stacked with the weights (views of one tensor), added once, and the
    outputs are the layers' computed one by one, bit for bit."""
    x, upstream = inputs()
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "off")
    alone = run(attention(bias=True), x, upstream)
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    parent = attention(bias=True)
    together = run(parent, x, upstream)
    biases = [getattr(parent, name).base.bias for name in OUTS]
    assert len({bias.untyped_storage().data_ptr() for bias in biases}) == 1
    assert parent.q_proj.siblings.stacked is not None and parent.q_proj.siblings.stacked.bias is not None
    for name in OUTS:
        assert torch.equal(together[0][name], alone[0][name]), name


def test_gradients_lying_side_by_side_are_taken_as_they_lie():
    """Gradients written into adjacent columns of one tensor are that tensor (no copy); others are concatenated."""
    whole = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)
    parts = whole.split([3, 4], dim=1)
    joined = lora_siblings.side_by_side(parts)
    assert joined.data_ptr() == whole.data_ptr() and torch.equal(joined, whole)
    apart = (parts[0].clone(), parts[1])
    copied = lora_siblings.side_by_side(apart)
    assert copied.data_ptr() != whole.data_ptr() and torch.equal(copied, whole)
    swapped = lora_siblings.side_by_side((parts[1], parts[0]))
    assert torch.equal(swapped, torch.cat([parts[1], parts[0]], dim=1))
    assert torch.equal(lora_siblings.side_by_side((whole[1:, :3], whole[1:, 3:])), whole[1:])


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
    assert len(calls) == (1 + 1 + 4) + (2 + 3)
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
    from tests.helpers.cuda_path_runs import assert_as_alone, on_the_cuda_path, one_rank_jobs, run_planned
    from tests.helpers.isolation import base_for

    on_the_cuda_path(monkeypatch, "grouped_mm")
    together = []
    real = lora_siblings._SiblingLinears.apply
    monkeypatch.setattr(lora_siblings._SiblingLinears, "apply", lambda *a: together.append(1) or real(*a))
    base = base_for("bfloat16")
    planned = one_rank_jobs()
    weights, losses, _ = run_planned(base, planned)
    assert together
    assert_as_alone(base, planned, weights, losses)
