"""The split-K kernel of the rank-wide LoRA products (actors/engine/rank_products.py) and the jagged kernel of the
weight gradients' sums (weight_grad_products.py) under Triton's interpreter on this CPU, in float32 (the interpreter
has no bfloat16 arithmetic): each segment's rows times its own job's factor within float32's rounding of the sum, both
forms, rows of several jobs in one block, empty and gap groups, one part and many; a job's rows untouched by other
jobs' values; each group's weight-gradient sum over its own rows, as alone; each kernel's check failing one that
mixes up jobs; and a fused layer, and layers sharing an input, on the CUDA path with both kernels (their arithmetic
in float32, rounded to bfloat16 by torch) within the bfloat16 bounds of the exact arithmetic. This module runs in a
process started with TRITON_INTERPRET=1 (test_rank_products.py starts it)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.triton_interpreter import triton_interpreted

pytestmark = pytest.mark.skipif(not triton_interpreted(), reason="needs Triton's interpreter on from the process's "
                                "start (TRITON_INTERPRET=1): test_rank_products.py runs it")

# a block of 64 rows holding three groups' rows (64..70, an empty one, 70..75, 75..): gaps and ends inside blocks
BOUNDS = [(0, 64), (64, 70), (70, 70), (70, 75), (75, 203)]
TOKENS, RANK = 203, 24


def _operands(features: int, transposed: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    left = torch.randn(TOKENS, features, generator=generator)
    shape = (len(BOUNDS), RANK, features) if transposed else (len(BOUNDS), features, RANK)
    return left, torch.randn(*shape, generator=generator), torch.tensor([end for _, end in BOUNDS], dtype=torch.int32)


@pytest.mark.parametrize("features,split", [(300, 128), (300, 4096), (1000, 256)],
                         ids=["3 parts, a partial K block", "1 part", "4 parts"])
@pytest.mark.parametrize("transposed", [True, False], ids=["x A^T", "g B"])
def test_each_segment_takes_its_own_job_s_factor(transposed, features, split):
    from actors.engine import rank_products

    left, weights, offsets = _operands(features, transposed)
    got = rank_products.split_k(left, weights, offsets, transposed, split_features=split)
    assert got.shape == (TOKENS, RANK) and got.dtype == left.dtype
    assert all(int(counters.abs().sum()) == 0 for counters in rank_products._COUNTERS.values())   # left for the next
    for group, (start, end) in enumerate(BOUNDS):
        factor = (weights[group].t() if transposed else weights[group]).double()
        exact = left[start:end].double() @ factor
        magnitude = left[start:end].double().abs() @ factor.abs()
        # a float32 sum of `features` products (each product exact in float64, each addition one rounding)
        assert bool(((got[start:end].double() - exact).abs() <= features * 2.0 ** -24 * magnitude).all()), group


@pytest.mark.parametrize("transposed", [True, False], ids=["x A^T", "g B"])
def test_other_jobs_values_never_reach_a_job_s_rows(transposed):
    """The job of rows 70..75 shares a row block with two others: with every other job's rows and factors changed
    (its own rows where they were), its rows come out bit for bit the same. (Bit for bit against the job alone in a
    stream of its own is a GPU test, tests/gpu/test_rank_products_cuda.py: NumPy's products under the interpreter
    round a row by its place in the block.)"""
    from actors.engine import rank_products

    left, weights, offsets = _operands(1000, transposed, seed=1)
    fused = rank_products.split_k(left, weights, offsets, transposed, split_features=256)
    other_left, other_weights, _ = _operands(1000, transposed, seed=2)
    other_left[70:75], other_weights[3] = left[70:75], weights[3]
    again = rank_products.split_k(other_left, other_weights, offsets, transposed, split_features=256)
    assert torch.equal(fused[70:75], again[70:75])
    assert not torch.equal(fused[:70], again[:70])


def test_the_once_a_device_check_passes_here_and_fails_a_kernel_that_mixes_up_jobs(monkeypatch):
    from actors.engine import rank_products

    assert rank_products.CHECK.works(torch.device("cpu"))
    kernel = rank_products.split_k
    monkeypatch.setattr(rank_products, "split_k", lambda left, weights, *args, **kwargs:
                        kernel(left, weights.roll(1, dims=0), *args, **kwargs))
    assert not rank_products._agrees(torch.device("cpu"))


@pytest.fixture
def on_split_k(monkeypatch):
    """The CUDA LoRA path on grouped_mm with its rank-wide products on the split-K kernel and its weight gradients'
    sums on the jagged kernel, each kernel's arithmetic in float32 and its result rounded to bfloat16 by torch (the
    interpreter's bfloat16 is not the GPU's); the kernels' calls, listed."""
    from actors.engine import lora_cuda, lora_siblings, rank_products, weight_grad_products

    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", "grouped_mm")
    monkeypatch.setattr(lora_siblings, "SIBLINGS", "on")
    monkeypatch.setattr(rank_products, "WAY", "split_k")
    monkeypatch.setattr(weight_grad_products, "WAY", "jagged")
    split_k, jagged = rank_products.split_k, weight_grad_products.jagged
    calls: list[object] = []

    def split_k_in_float32(left, weights, offsets, transposed, split_features=rank_products.SPLIT_FEATURES[0]):
        calls.append(transposed)
        return split_k(left.float(), weights.float(), offsets, transposed, 16).to(left.dtype)

    def jagged_in_float32(left, right, offsets):
        calls.append("jagged")
        return jagged(left.float(), right.float(), offsets).to(left.dtype)

    monkeypatch.setattr(rank_products, "split_k", split_k_in_float32)
    monkeypatch.setattr(weight_grad_products, "jagged", jagged_in_float32)
    return calls


def test_a_layer_on_the_triton_kernels_is_within_the_bfloat16_bounds_of_the_exact_arithmetic(on_split_k):
    """tests/helpers/lora_bounds.py's three jobs (ranks 4, 8, 2, padded to 8 in the stacks): output, input gradient and
    each job's gradients within the bounds its docstring derives; both forms went through the kernel."""
    from tests.helpers.lora_bounds import IN, OUT, assert_layer_within, bf16_values, fused_layer, layout_of, run_layer

    layer = fused_layer()
    torch.manual_seed(3)
    x, upstream = bf16_values(1, 57, IN), bf16_values(1, 57, OUT)
    out, grad_x = run_layer(layer, x, upstream, layout_of())
    assert set(on_split_k) == {False, True, "jagged"}
    assert_layer_within(layer, x, upstream, out, grad_x)


def test_layers_sharing_an_input_on_the_triton_kernels_are_within_the_bounds(on_split_k):
    """q, k and v of three jobs computed together (actors/engine/lora_siblings.py), their Σ ranks one product each
    way through the kernel."""
    from tests.helpers.sibling_layers import assert_within_the_bounds, attention, inputs

    x, upstream = inputs()
    assert_within_the_bounds(attention(), x, upstream)
    assert set(on_split_k) == {False, True, "jagged"}


@pytest.mark.parametrize("m,n", [(24, 300), (300, 24)], ids=["dA's shape", "dB's shape"])
def test_the_jagged_kernel_sums_each_group_over_its_own_rows_and_as_alone(m, n):
    """Each group's left[rows]^T right[rows] within float32's rounding of its sum (an empty group: zeros), and bit
    for bit what the group gives alone in a stream of its own (its rows summed in the same blocks)."""
    from actors.engine import weight_grad_products

    generator = torch.Generator().manual_seed(4)
    left, right = torch.randn(TOKENS, m, generator=generator), torch.randn(TOKENS, n, generator=generator)
    offsets = torch.tensor([end for _, end in BOUNDS], dtype=torch.int32)
    got = weight_grad_products.jagged(left, right, offsets)
    assert got.shape == (len(BOUNDS), m, n)
    for group, (start, end) in enumerate(BOUNDS):
        first, second = left[start:end].double().t(), right[start:end].double()
        bound = (end - start) * 2.0 ** -24 * (first.abs() @ second.abs())
        assert bool(((got[group].double() - first @ second).abs() <= bound).all()), group
        alone = weight_grad_products.jagged(left[start:end].contiguous(), right[start:end].contiguous(),
                                            torch.tensor([end - start], dtype=torch.int32))
        assert torch.equal(got[group], alone[0]), group


def test_the_jagged_kernel_s_check_passes_here_and_fails_a_kernel_that_mixes_up_jobs(monkeypatch):
    from actors.engine import weight_grad_products

    assert weight_grad_products.CHECK.works(torch.device("cpu"))
    kernel = weight_grad_products.jagged
    monkeypatch.setattr(weight_grad_products, "jagged", lambda *args: kernel(*args).roll(1, dims=0))
    assert not weight_grad_products._agrees(torch.device("cpu"))
