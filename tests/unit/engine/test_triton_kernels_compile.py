"""The engine's own Triton kernels compiled for a Hopper GPU (sm_90) on this CPU, down to the cubin by Triton's
bundled ptxas: what the interpreter cannot show (it runs the kernels' Python with numpy's exact arithmetic and
Python's doubles for scalars) and used to wait for a GPU lease to show. A kernel whose branches give one name two
types, or an operation the compiler rejects, fails here; and the flat AdamW's square root and divisions are the
IEEE-rounded instructions (sqrt.rn, div.rn), never the approximate ones Triton's `tl.sqrt` and `/` compile to
(sqrt.approx, div.full): the H200 lease of 2026-12-04 failed its rounding bound with those."""

from __future__ import annotations

import pytest

from actors.engine import (
    flat_adamw,
    lora_grad_kernel,
    lora_stacks,
    rank_products,
    strided_kernels,
    weight_grad_products,
)

triton = pytest.importorskip("triton")

HOPPER = (90, 32)   # compute capability 9.0, 32-thread warps

ADAMW_SCALARS = ("decay_a", "decay_b", "step_size_a", "step_size_b", "inverse_targets", "beta1", "one_minus_beta1",
                 "beta2", "one_minus_beta2", "eps", "bias2_sqrt", "scaling")
KERNELS = {
    "flat AdamW": (lambda: flat_adamw._adamw_kernel,
                   {"param": "*fp32", "grad": "*fp32", "exp_avg": "*fp32", "exp_avg_sq": "*fp32", "cast": "*bf16",
                    "factor": "*fp32", "n": "i32", "b_start": "i32", **dict.fromkeys(ADAMW_SCALARS, "fp32"),
                    "HAS_CAST": "constexpr", "BLOCK_SIZE": "constexpr"},
                   {"HAS_CAST": True, "BLOCK_SIZE": flat_adamw.BLOCK}),
    "grouped gradients": (lambda: lora_grad_kernel._add_groups_kernel,
                          {"targets": "*i64", "meta": "*i64", "groups": "i32", "BLOCK_SIZE": "constexpr"},
                          {"BLOCK_SIZE": lora_grad_kernel.BLOCK}),
    "kept stacks' copy": (lambda: lora_stacks._copy_slots_kernel, {"table": "*i64", "BLOCK_SIZE": "constexpr"},
                          {"BLOCK_SIZE": lora_stacks.BLOCK}),
    "row-strided SwiGLU": (lambda: strided_kernels._swiglu_forward,
                           {"a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "a_stride": "i32",
                            "b_stride": "i32", "out_stride": "i32", "cols": "i32", "BLOCK": "constexpr"},
                           {"BLOCK": strided_kernels.SWIGLU_BLOCK}),
    "the rank-wide LoRA products' split-K kernel": (
        lambda: rank_products._rank_product_kernel,
        {"left_ptr": "*bf16", "w_ptr": "*bf16", "ends_ptr": "*i32", "out_ptr": "*bf16", "sums_ptr": "*fp32",
         "counts_ptr": "*i32", "tokens": "i32", "features": "i32", "width": "i32", "groups": "i32", "per_part": "i32",
         "parts": "i32", "left_row": "i32", "left_col": "i32", "w_group": "i32", "w_k": "i32", "w_n": "i32",
         "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
        {"BLOCK_M": rank_products.BLOCK_M, "BLOCK_N": 64, "BLOCK_K": rank_products.BLOCK_K}),
    "the weight gradients' jagged kernel": (
        lambda: weight_grad_products._jagged_kernel,
        {"left_ptr": "*bf16", "right_ptr": "*bf16", "ends_ptr": "*i32", "out_ptr": "*bf16", "m": "i32", "n": "i32",
         "tiles_n": "i32", "left_row": "i32", "left_col": "i32", "right_row": "i32", "right_col": "i32",
         "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_T": "constexpr"},
        {"BLOCK_M": weight_grad_products.WIDE, "BLOCK_N": 64, "BLOCK_T": weight_grad_products.BLOCK_T}),
    "row-strided SwiGLU's backward": (lambda: strided_kernels._swiglu_backward,
                                      {"grad_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "grad_stride": "i32",
                                       "a_stride": "i32", "b_stride": "i32", "cols": "i32", "BLOCK": "constexpr"},
                                      {"BLOCK": strided_kernels.SWIGLU_BLOCK}),
}


def _compiled(name: str):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, signature, constexprs = KERNELS[name]
    source = ASTSource(fn=kernel(), signature=signature, constexprs=constexprs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", *HOPPER))
    except (RuntimeError, FileNotFoundError) as error:   # no CUDA backend or ptxas in this Triton install
        if "ptxas" in str(error) or "backend" in str(error).lower():
            pytest.skip(f"Triton cannot compile for CUDA here: {error}")
        raise


@pytest.mark.skipif(flat_adamw.triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("name", list(KERNELS))
def test_the_kernel_compiles_for_hopper(name):
    compiled = _compiled(name)
    assert compiled.asm["cubin"], name


@pytest.mark.skipif(flat_adamw.triton is None, reason="Triton is not installed")
def test_the_flat_adamw_rounds_its_square_root_and_divisions_as_ieee():
    ptx = _compiled("flat AdamW").asm["ptx"]
    assert "sqrt.rn.f32" in ptx and "div.rn.f32" in ptx
    assert "sqrt.approx" not in ptx and "div.full" not in ptx and "div.approx" not in ptx


@pytest.mark.skipif(flat_adamw.triton is None, reason="Triton is not installed")
def test_the_host_s_grid_helpers_equal_triton_s():
    """triton_support's cdiv and next_power_of_2 (host code without Triton's constexpr wrapper) give Triton's values."""
    from actors.engine.triton_support import cdiv, next_power_of_2

    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 7, 64, 1024):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
