"""bench/lora_split_k.py's kernel (the `split_k` way of bench/lora_products.py, run on a GPU by the lease) under
Triton's interpreter on this CPU, in float32 (the interpreter has no bfloat16 arithmetic): on uneven segments, with
rows that do not fill a tile and a feature count that is not a multiple of the K block, both of its forms (x A^T with
A read transposed; g B) give each segment's product with its own job's factors, within float32's rounding of the sum.
This module runs in a process started with TRITON_INTERPRET=1 (test_lora_products_bench.py starts it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch


def _interpreted() -> bool:
    """Triton's library functions were made interpreted (TRITON_INTERPRET=1 before triton's first import)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


pytestmark = pytest.mark.skipif(not _interpreted(), reason="needs Triton's interpreter on from the process's "
                                "start (TRITON_INTERPRET=1): test_lora_products_bench.py runs it")
REPO = Path(__file__).resolve().parents[3]


def _split_k():
    spec = importlib.util.spec_from_file_location("lora_split_k", REPO / "bench" / "lora_split_k.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_split_k"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("transposed", [True, False], ids=["x A^T", "g B"])
def test_each_segment_takes_its_own_job_s_factors(transposed):
    split_k = _split_k()
    generator = torch.Generator().manual_seed(0)
    bounds = [(0, 70), (70, 75), (75, 203)]   # a segment of 5 rows; tiles that end inside a segment
    tokens, features, rank = 203, 300, 24      # 300 features: not a multiple of the 128-feature block
    left = torch.randn(tokens, features, generator=generator)
    shape = (len(bounds), rank, features) if transposed else (len(bounds), features, rank)
    weights = torch.randn(*shape, generator=generator)
    got = split_k.rank_product(left, weights, split_k.tiles_of(bounds, left.device), transposed, multiprocessors=4)
    for group, (start, end) in enumerate(bounds):
        factor = weights[group].t() if transposed else weights[group]
        exact = left[start:end].double() @ factor.double()
        magnitude = left[start:end].double().abs() @ factor.double().abs()
        assert bool(((got[start:end].double() - exact).abs() <= features * 2.0 ** -23 * magnitude).all()), group
