"""The base-model settings, one type alias each: quantization, dtype, layout, recompute, compile, kernels.

A jobs file (`RunSpec`), a submission (`JobSubmission`) and a trainer (`TrainerConfig`) share them, so each
set of values is spelled once: how the frozen base is quantized and in which dtype it computes, how a fused
step lays out its tokens, whether the decoder layers recompute their activations in backward, whether
they run under torch.compile, and whether its memory-bound operations run as fused kernels. No torch here: the
specs import these without loading the engine (`packing`, `recompute`, `compiled` and `kernels` implement
them)."""

from __future__ import annotations

from typing import Literal, get_args

Quantization = Literal["none", "int8", "nf4"]
"""The frozen base's linear layers: full precision, or bitsandbytes' int8 / nf4 (the `quant` extra)."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""The base's compute dtype; auto: float32 on CPU, bfloat16 on CUDA."""

Layout = Literal["packed", "padded", "padded_fused"]
"""A fused step's token layout: packed (no padding), padded (each job's rows to its longest) or
padded_fused (mLoRA: every row to the step's longest)."""

Recompute = Literal["none", "layers"]
"""layers: keep only each decoder layer's input for backward and recompute the layer there."""

Compile = Literal["none", "default", "graphs"]
"""default: the decoder layers of each fused step under torch.compile (inductor); graphs: each fused step of a fixed
shape captured once as a CUDA graph and replayed (a host-bound step: a small base on a large GPU)."""

Kernels = Literal["auto", "liger", "none"]
"""liger: Liger-Kernel's fused RMSNorm (each residual addition with the norm after it in one kernel), RoPE, SwiGLU
and LM-head cross-entropy (the `gpu` extra); auto: those where Liger is installed and the base is on CUDA in bfloat16 /
float16; none: the model's own operations."""

QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
DTYPES: tuple[str, ...] = get_args(Dtype)
LAYOUTS: tuple[str, ...] = get_args(Layout)
RECOMPUTE_MODES: tuple[str, ...] = get_args(Recompute)
COMPILE_MODES: tuple[str, ...] = get_args(Compile)
KERNEL_MODES: tuple[str, ...] = get_args(Kernels)
