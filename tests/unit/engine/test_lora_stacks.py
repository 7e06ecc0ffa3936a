"""The grouped_mm path's stacks of the jobs' copies kept between steps (actors/engine/lora_stacks.py), on the CPU (the
CUDA path run there in bfloat16): after the masters change (as an optimizer step changes them), the next step's
output and gradients are bit for bit those of a copy of the layer that stacks afresh; the kept stacks are refreshed
by one multi-tensor copy for every layer, not stacked again; a new grouping (another set of jobs in the step) is
stacked afresh and replaces the layer's kept one."""

from __future__ import annotations

import pytest
import torch

from actors.engine import lora_cuda, lora_layer_state, lora_stacks
from actors.engine.layout import step_layout
from tests.helpers.lora_bounds import IN, OUT, bf16_values, layout_of, pooled_layer


@pytest.fixture(autouse=True)
def _grouped_on_this_cpu(monkeypatch):
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")


def _step(layer, x, upstream, layout):
    for adapter in layer.adapters.values():
        adapter.lora_A.grad = adapter.lora_B.grad = None
    with step_layout(layout):
        out = layer(x)
    (out.float() * upstream.float()).sum().backward()
    return out.detach(), {name: (a.lora_A.grad.clone(), a.lora_B.grad.clone()) for name, a in layer.adapters.items()
                          if a.lora_A.grad is not None}


def _calls(monkeypatch):
    """Counts stackings and refreshes; a refresh is one multi-tensor copy, or one launch of the stacks' copy kernel
    where Triton runs (a GPU, or this CPU under TRITON_INTERPRET=1), both counted as `foreach_copy`."""
    counted = {"stack": 0, "foreach_copy": 0}
    stack, foreach_copy, launch = torch.stack, torch._foreach_copy_, lora_stacks.launch_slots
    monkeypatch.setattr(torch, "stack", lambda *a, **k: counted.__setitem__("stack", counted["stack"] + 1)
                        or stack(*a, **k))
    monkeypatch.setattr(torch, "_foreach_copy_", lambda *a, **k: counted.__setitem__(
        "foreach_copy", counted["foreach_copy"] + 1) or foreach_copy(*a, **k))
    monkeypatch.setattr(lora_stacks, "launch_slots", lambda *a, **k: counted.__setitem__(
        "foreach_copy", counted["foreach_copy"] + 1) or launch(*a, **k))
    return counted


def test_kept_stacks_follow_the_masters_bit_for_bit(monkeypatch):
    layer = pooled_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    _step(layer, x, upstream, layout_of())
    counted = _calls(monkeypatch)
    for step in range(2):
        with torch.no_grad():   # as an optimizer step changes the masters in place
            for index, adapter in enumerate(layer.adapters.values()):
                adapter.lora_A.add_(0.25 * (index + 1))
                adapter.lora_B.mul_(0.5)
        fresh = pooled_layer(like=layer)   # another layer: nothing kept for it
        ours = _step(layer, x, upstream, layout_of())
        theirs = _step(fresh, x, upstream, layout_of())
        assert torch.equal(ours[0], theirs[0]), step
        for name in ours[1]:
            assert torch.equal(ours[1][name][0], theirs[1][name][0]) and torch.equal(ours[1][name][1],
                                                                                   theirs[1][name][1]), (step, name)
    # each of our steps: one multi-tensor copy refreshing the kept stacks, no stacking; the fresh layers stacked
    # (and the fresh layers' own refreshes: each step's first one copies every kept layer's stacks)
    assert counted["stack"] == 2 * 2
    assert counted["foreach_copy"] >= 2


def _kept_groupings(layer) -> list[tuple]:
    return [key for (ident, key) in lora_stacks.KEPT.entries if ident == id(layer.base)]


def test_another_grouping_is_stacked_afresh_and_kept_beside_the_first(monkeypatch):
    """A layer keeps the stacks of up to GROUPINGS groupings of adapters (a step's beside an evaluation's or a
    generation's), the least recently used dropped first; each found again is not stacked again."""
    layer = pooled_layer()
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    _step(layer, x, upstream, layout_of())
    (first,) = _kept_groupings(layer)
    other = layout_of(((0, 20), (20, 57)), ["job0", "job2"])
    counted = _calls(monkeypatch)
    out, _ = _step(layer, x, upstream, other)
    assert counted["stack"] == 2 and len(_kept_groupings(layer)) == 2 and first in _kept_groupings(layer)
    assert torch.equal(out, _step(pooled_layer(like=layer), x, upstream, other)[0])
    counted.update(stack=0, foreach_copy=0)
    _step(layer, x, upstream, layout_of())            # the first grouping again: found, not stacked
    assert counted["stack"] == 0
    pairs = [["job1", "job2"], ["job0", "job1"], ["job1", "job0"], ["job2", "job1"]][:lora_stacks.GROUPINGS]
    groupings = [layout_of(((0, 20), (20, 57)), pair) for pair in pairs]
    for grouping in groupings[:-1]:   # as many as the layer keeps beside the first
        _step(layer, x, upstream, grouping)
    kept = _kept_groupings(layer)
    assert len(kept) == lora_stacks.GROUPINGS and first in kept   # the least recently used was another: kept
    _step(layer, x, upstream, groupings[-1])
    assert first not in _kept_groupings(layer)                     # now it is the least recently used: dropped
    lora_layer_state.forget_masters(layer.base)   # a layer whose adapters leave keeps nothing
    assert not _kept_groupings(layer)


def test_a_layer_that_is_gone_leaves_nothing_kept():
    import gc

    layer = pooled_layer()
    _step(layer, bf16_values(1, 57, IN), bf16_values(1, 57, OUT), layout_of())
    ident = id(layer.base)
    assert any(where[0] == ident for where in lora_stacks.KEPT.entries)
    del layer
    gc.collect()
    assert not any(where[0] == ident for where in lora_stacks.KEPT.entries)


def test_a_copy_kernel_that_fails_its_check_leaves_the_refresh_to_torch(monkeypatch, caplog):
    """Where Triton runs, the kept stacks are refreshed by one kernel over a table of addresses; one that fails its
    once-a-device check is logged once, and the multi-tensor copy refreshes them, bit for bit as before."""
    def broken(device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(lora_stacks, "triton_runs", lambda device: True)
    monkeypatch.setattr(lora_stacks.CHECK, "checked", {})
    monkeypatch.setattr(lora_stacks.CHECK, "agrees", broken)
    test_kept_stacks_follow_the_masters_bit_for_bit(monkeypatch)
    assert lora_stacks.CHECK.checked == {"cpu": False}
    warnings = [r.getMessage() for r in caplog.records if "stacks' copy kernel" in r.getMessage()]
    assert len(warnings) == 1 and "no compiler here" in warnings[0]


def test_a_job_that_leaves_leaves_no_stacks_of_its_adapter_kept(monkeypatch):
    """Its layers' stacks and those of the layers computed together (lora_siblings.py) go with it: kept, they would
    hold its compute-dtype copy (its memory) and be refreshed every step, and a later adapter at its address would
    find them (their grouping is keyed by the adapters' identities)."""
    import copy

    from actors.engine import lora_siblings
    from actors.engine.job import TrainingJob
    from actors.engine.lora_masters import pool_of
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.models import random_examples, tiny_model

    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    base = from_module(copy.deepcopy(tiny_model("llama", VOCAB)).to(torch.bfloat16), None)
    trainer = FusedTrainer(base, step_tokens=100_000)
    for name, seed in (("a", 0), ("b", 1)):
        spec = job_spec(name, lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]})
        trainer.add_job(TrainingJob.create(spec, base, random_examples(seed, vocab=VOCAB), [], seed=seed))
    trainer.train_step()
    cast = next(iter(pool_of(trainer.jobs["b"].optimizer.parameters).casts.values()))
    start, end = cast.data_ptr(), cast.data_ptr() + cast.numel() * cast.element_size()

    def holding_b() -> int:
        return sum(start <= source.data_ptr() < end for entry in lora_stacks.KEPT.entries.values()
                   for source in entry[4])

    assert holding_b() > 0 and any(isinstance(entry[0](), lora_siblings.SiblingSet)
                                   for entry in lora_stacks.KEPT.entries.values())
    trainer.remove_job("b")
    assert holding_b() == 0
