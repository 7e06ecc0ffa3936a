"""MoE experts computed job by job on the CPU (actors/engine/moe_experts.py), against transformers' own experts
forward (its eager loop) on each MoE family's tiny model: the same output within float32's rounding, and each
job's rows exactly as that job computes alone, forward and backward (what makes fused MoE jobs train bit for bit
as alone: tests/unit/engine/test_isolation.py); the groups a step's layouts make."""

from __future__ import annotations

import inspect

import pytest
import torch

from actors.engine.layout import StepLayout, step_layout
from actors.engine.models import from_module
from actors.engine.moe_experts import EXPERTS_NAME, use_segment_experts
from tests.helpers.model_families import build_config, build_model, relative

MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "granitemoe", "deepseek_v3", "glm4_moe",
             "ernie4_5_moe", "deepseek_v2", "glm4_moe_lite", "dots1", "exaone_moe", "solar_open", "afmoe", "flex_olmo",
             "minimax_m2", "hunyuan_v1_moe"]
SEGMENTS = [("a", 0, 3), ("b", 3, 19), ("c", 19, 21), ("d", 21, 40)]   # short segments: few rows an expert


def _experts_and_routes(model: torch.nn.Module, hidden: torch.Tensor):
    """The first MoE block's experts and its router's choices for `hidden` (routers answer (logits, weights,
    indices) on every type here)."""
    block = next(module for module in model.modules() if hasattr(module, "experts"))
    router = block.gate if hasattr(block, "gate") else block.router
    # afmoe's and minimax_m2's routers take the block's expert bias, by its name, as a second argument; afmoe's
    # takes the hidden states with their batch dimension
    extra = [getattr(block, name) for name in list(inspect.signature(router.forward).parameters)[1:]]
    _, weights, index = router(hidden[None] if type(block).__name__ == "AfmoeSparseMoeBlock" else hidden, *extra)
    return block.experts, index, weights


def _layout(segments) -> StepLayout:
    sequences = tuple((start, end) for _, start, end in segments)
    return StepLayout(tuple(segments), sequences, segments[-1][2])


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_segment_experts_equal_transformers_and_each_segment_alone(model_type):
    config = build_config(model_type)
    ours = from_module(build_model(config), None).model
    assert ours.config._experts_implementation == EXPERTS_NAME
    eager = build_model(build_config(model_type))
    eager.set_experts_implementation("eager")
    hidden = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, index, weights = _experts_and_routes(ours, hidden)
    reference = _experts_and_routes(eager, hidden)[0](hidden, index, weights)

    leaf = hidden.clone().requires_grad_(True)
    with step_layout(_layout(SEGMENTS)):
        fused = experts(leaf, index, weights)
    assert relative(fused, reference) <= 1e-6
    upstream = torch.randn(fused.shape, generator=torch.Generator().manual_seed(1))
    (fused * upstream).sum().backward()
    for name, start, end in SEGMENTS:
        alone_leaf = hidden[start:end].clone().requires_grad_(True)
        with step_layout(_layout([(name, 0, end - start)])):
            alone = experts(alone_leaf, index[start:end], weights[start:end])
        assert torch.equal(alone, fused[start:end]), (model_type, name)
        (alone * upstream[start:end]).sum().backward()
        assert torch.equal(alone_leaf.grad, leaf.grad[start:end]), (model_type, name)


def test_only_cpu_models_with_experts_take_it():
    dense = build_model(build_config("llama"))
    assert not use_segment_experts(dense)
    moe = build_model(build_config("mixtral"))
    assert use_segment_experts(moe) and moe.config._experts_implementation == EXPERTS_NAME


def test_groups_are_the_jobs_whatever_the_segments_name():
    """A step's groups are its jobs' tokens: the segments' ranges, each group owned by its segment's adapter; a
    reference pass, which names only the jobs with a reference adapter, keeps the batch's jobs (StepLayout.jobs),
    the others owned by none; a padded tail past the last job is a group of its own; outside a step, one group."""
    from actors.engine import moe_experts

    cpu = torch.device("cpu")
    sequences = ((0, 5), (5, 12), (12, 40))
    with step_layout(StepLayout((("a", 0, 12), ("b", 12, 40)), sequences, 40)):
        groups, owners = moe_experts._group_of_tokens(40, cpu)
    assert owners == ["a", "b"] and groups.tolist() == [0] * 12 + [1] * 28
    with step_layout(StepLayout((("b-reference", 12, 30),), sequences, 40, jobs=((0, 12), (12, 30), (30, 40)))):
        groups, owners = moe_experts._group_of_tokens(40, cpu)
    assert owners == [None, "b-reference", None] and groups.tolist() == [0] * 12 + [1] * 18 + [2] * 10
    with step_layout(StepLayout((("a", 0, 10), ("b", 10, 32)), sequences, 40)):   # 8 tokens of padding
        groups, owners = moe_experts._group_of_tokens(40, cpu)
    assert owners == ["a", "b", None] and groups.tolist() == [0] * 10 + [1] * 22 + [2] * 8
    groups, owners = moe_experts._group_of_tokens(40, cpu)
    assert owners == [None] and groups.tolist() == [0] * 40


def test_a_reference_pass_groups_by_the_batchs_jobs():
    """actors/engine/preference.py's reference layout names the jobs that have a reference adapter; the others'
    tokens still group as their own jobs."""
    from actors.engine.packing import JobMicroBatch, pack
    from actors.engine.preference import reference_layout
    from tests.helpers.models import random_examples

    batch = pack([JobMicroBatch(name, random_examples(index, count=2, vocab=50, min_len=4, max_len=9))
                  for index, name in enumerate(("a", "b", "c"))])
    layout = reference_layout(batch, {"b": "b-reference"})
    assert [name for name, _, _ in layout.segments] == ["b-reference"]
    assert layout.job_ranges == batch.layout.job_ranges == tuple((s, e) for _, s, e in batch.layout.segments)
