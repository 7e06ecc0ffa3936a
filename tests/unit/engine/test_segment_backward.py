"""A fused step's backward costs what its tokens cost, whatever the number of jobs, sequences or (expert, job)
groups that cut them (`actors.engine.layout.parts`): autograd's backward of a slice makes a zero gradient the size
of the whole tensor and writes the slice's part into it, so a slice a part wrote (zeros, then their sum) the whole
tensor once per part: on an OLMoE-shaped CPU step, 81 groups a layer over a 9.5 MB tensor. Checked by counting the
bytes that the operations of a forward and backward write (a dispatch mode) at 1 part and at many, each bound
derived from what each more part may add; and the gradients against plain slices (autograd's own reference)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from actors.data import Example
from actors.engine.attention import varlen_attention_forward
from actors.engine.job import TrainingJob
from actors.engine.layout import StepLayout, parts, step_layout
from actors.engine.models import from_module
from actors.engine.operations import VIEW_OPERATIONS
from tests.helpers.fused import job_spec
from tests.helpers.model_families import build_config, build_model


class WrittenBytes(TorchDispatchMode):
    """Bytes of the tensors that the operations which do work return (views left out: they write nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in VIEW_OPERATIONS:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
        return out


def written_bytes(work) -> int:
    with WrittenBytes() as counter:
        work()
    return counter.bytes


def _lengths(count: int, total: int) -> list[int]:
    """`count` lengths summing to `total`, unequal."""
    rng = random.Random(count)
    cuts = sorted(rng.sample(range(1, total), count - 1))
    return [end - start for start, end in zip([0, *cuts], [*cuts, total], strict=True)]


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for length in lengths:
        bounds.append((start, start + length))
        start += length
    return bounds


def test_parts_are_the_slices_and_their_gradients_the_slices_gradients():
    tensor = torch.randn(5, 30, 3, generator=torch.Generator().manual_seed(0))
    bounds = [(2, 9), (9, 9), (12, 20), (20, 27)]   # a gap before, an empty part, a gap between, a tail after
    upstream = [torch.randn(5, end - start, 3, generator=torch.Generator().manual_seed(start))
                for start, end in bounds]
    ours = tensor.clone().requires_grad_(True)
    sliced = tensor.clone().requires_grad_(True)
    got = parts(ours, bounds, dim=1)
    expected = [sliced[:, start:end] for start, end in bounds]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    sum((part * grad).sum() for part, grad in zip(got, upstream, strict=True)).backward()
    sum((part * grad).sum() for part, grad in zip(expected, upstream, strict=True)).backward()
    assert torch.equal(ours.grad, sliced.grad)


def test_parts_refuse_bounds_out_of_order():
    with pytest.raises(ValueError, match="overlap or are not in order"):
        parts(torch.zeros(10), [(4, 8), (2, 3)])


def test_attention_backward_writes_nothing_more_per_sequence():
    """The varlen attention's CPU way (a causal attention a sequence): 64 sequences write what one does, and the
    outputs' cat."""
    heads, dim, total = 4, 8, 512
    size = heads * total * dim * 4   # q's bytes (k's, v's: as many heads here)

    def step(count: int) -> int:
        generator = torch.Generator().manual_seed(count)
        q, k, v = (torch.randn(1, heads, total, dim, generator=generator, requires_grad=True) for _ in range(3))
        sequences = tuple(_bounds(_lengths(count, total)))
        layout = StepLayout((("a", 0, total),), sequences, total)

        def work():
            with step_layout(layout):
                out, _ = varlen_attention_forward(torch.nn.Module(), q, k, v, None, scaling=dim ** -0.5)
            out.sum().backward()
        return written_bytes(work)

    # a slice a sequence wrote q, k and v's gradients whole per sequence (zeros, then their sum): 64 x 6 x size
    assert step(64) <= step(1) + 2 * size


def test_lora_layer_backward_writes_nothing_more_per_job_than_its_adapter():
    """A model's LoRA updates, segment by segment (the CPU way): each job more writes its own adapter's gradients
    and rank-r products, nothing the size of the step's tokens."""
    config = build_config("llama")
    total = 256

    def step(count: int) -> tuple[int, int]:
        base = from_module(build_model(config), None)
        for index in range(count):
            TrainingJob.create(job_spec(f"job-{index}"), base, [Example((5, 6, 7), (5, 6, 7))], [], seed=index)
        segments = tuple((f"job-{index}", start, end)
                         for index, (start, end) in enumerate(_bounds(_lengths(count, total))))
        layout = StepLayout(segments, tuple((start, end) for _, start, end in segments), total)
        ids = torch.randint(3, config.vocab_size, (1, total), generator=torch.Generator().manual_seed(count))

        def work():
            with step_layout(layout):
                logits = base.model(input_ids=ids, use_cache=False).logits
            logits.float().square().mean().backward()
        adapter = sum(p.numel() * p.element_size() for p in base.model.parameters() if p.requires_grad) // count
        return written_bytes(work), adapter

    two, adapter = step(2)
    sixteen, _ = step(16)
    # each more job: its A and B gradients, their rank-r inputs' gradients (as many bytes at most), twice over for
    # margin; a slice a job wrote every adapted layer's input gradient whole per job (14 x 2 x 256 x hidden x 4
    # bytes a layer more: 12x this bound here)
    assert sixteen - two <= 14 * 4 * adapter


def test_moe_experts_backward_writes_nothing_more_per_expert_and_job():
    """The experts job by job (actors/engine/moe_experts.py): 8 jobs' (expert, job) groups write what one job's
    experts do, and the routed rows' gradient once more."""
    config = build_config("olmoe")
    model = from_module(build_model(config), None).model
    block = next(module for module in model.modules() if hasattr(module, "experts"))
    total = 256
    rows = total * config.num_experts_per_tok * config.hidden_size * 4   # the routed rows' gradient, whole

    def step(count: int) -> int:
        generator = torch.Generator().manual_seed(count)
        hidden = torch.randn(total, config.hidden_size, generator=generator, requires_grad=True)
        segments = tuple((f"job-{index}", start, end) for index, (start, end)
                         in enumerate(_bounds(_lengths(count, total))))
        layout = StepLayout(segments, tuple((start, end) for _, start, end in segments), total)

        def work():
            with step_layout(layout):
                _, weights, index = block.gate(hidden.detach())
                out = block.experts(hidden, index, weights)
            out.sum().backward()
        return written_bytes(work)

    # a slice a group wrote the routed rows' gradient whole (zeros, then their sum) per (expert, job) group
    assert step(8) <= step(1) + rows
