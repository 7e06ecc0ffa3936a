"""What the recorder knows of aten operations: the record of one (`Op`), the operations' families (views
and allocations launch no kernel; matmuls, attention, gathers, scatters, fills, reductions have rules of
their own), the bytes an operand moves, a matmul's dimensions, and how an elementwise kernel walks memory
(`layout_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

# operations that launch no kernel: views, allocations, metadata
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "resize_", "set_", "_reshape_alias", "as_strided", "_unsafe_view", "view",
             "t", "transpose", "permute", "expand", "squeeze", "unsqueeze", "slice", "select", "split",
             "split_with_sizes", "unbind", "chunk", "narrow", "unfold", "view_as_real", "view_as_complex",
             "_nested_tensor_from_mask", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "is_same_size", "_has_compatible_shallow_copy_type", "record_stream", "_local_scalar_dense",
             "_make_dep_token", "lift", "_version", "conj", "_conj", "_neg_view", "resolve_conj", "resolve_neg",
             "is_nonzero"}
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "argwhere",
                  "nonzero_static", "repeat_interleave", "bincount", "histc"}
# factories and fills whose output's values do not depend on their first operand's (a shape, or the target):
# their values are kept for small device tensors (autograd's seed gradient, `ones_like` of the loss)
VALUE_FREE = {"full", "full_like", "ones", "ones_like", "zeros", "zeros_like", "fill", "fill_", "zero_",
              "scalar_tensor", "new_full", "new_ones", "new_zeros"}
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addbmm", "_scaled_mm", "_scaled_grouped_mm",
           "addmm_", "baddbmm_", "addbmm_"}   # the in-place forms accumulate into their first argument
ATTENTION = {"_varlen_attn", "_varlen_attn_backward", "_flash_attention_forward", "_flash_attention_backward",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
             "_efficient_attention_forward", "_efficient_attention_backward"}
ATTENTION_TILE = 128   # the flash kernels' query and key block
# gathers: they read the rows they take, not their whole source
GATHERS = {"index", "index_select", "gather", "embedding", "take", "_unsafe_index", "take_along_dim"}
# scatters: they write (read-modify-write when accumulating) the rows they touch, not their whole target
SCATTERS = {"index_put_", "_index_put_impl_", "index_put", "index_add_", "index_add", "scatter_add_",
            "scatter_add", "scatter_", "scatter", "index_copy_", "index_fill_", "masked_scatter_",
            "_unsafe_index_put", "embedding_dense_backward", "index_reduce_"}
# multi_tensor_apply: how many tensors one launch takes, by the number of tensor lists (torch's
# depth_to_max_tensors), and at most 320 blocks of 65,536 elements per launch
FOREACH_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
FOREACH_CHUNK, FOREACH_BLOCKS = 65536, 320


@dataclass(slots=True)
class Op:
    """One recorded operation. `kind`: kernel (device work), view (no kernel), host (a CPU tensor's
    operation: host time only), h2d / d2h (a copy across), sync (a host wait with no operation: a host read,
    torch.cuda.synchronize)."""

    name: str
    kind: str
    launches: int = 0
    flops: float = 0.0
    read: float = 0.0          # bytes
    written: float = 0.0
    dtype: str = ""
    sync: bool = False
    node: str | None = None    # the autograd node it runs in (backward), else None
    gemm: tuple[int, int, int, int] | None = None   # (batch, M, N, K)
    detail: dict = field(default_factory=dict)
    shapes: tuple = ()         # (shape, stride, dtype) of the tensor inputs, then the outputs (kernels only)
    calls: int = 0             # torch functions and methods called from Python since the operation before
    new_node: bool = False     # the first operation of an autograd node (backward)
    python: int = 0            # Python functions called since the operation before (the harness's aside)

    @property
    def bytes(self) -> float:
        return self.read + self.written


def tensors(value: Any) -> list[torch.Tensor]:
    return [item for item in tree_flatten(value)[0] if isinstance(item, torch.Tensor)]


def touched_bytes(tensor: torch.Tensor) -> int:
    """Bytes an operation reads or writes of this tensor: its elements, a broadcast (stride-0) dimension
    counted once."""
    count = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            count *= size
    return count * tensor.element_size()


FILLS = {"empty", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
         "new_full", "fill_", "zero_", "arange", "scalar_tensor", "eye", "linspace", "randn", "rand", "randint",
         "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "masked_fill_"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm", "var", "std", "prod",
              "logsumexp", "argmax", "argmin", "all", "any", "cumsum", "_log_softmax", "_softmax",
              "_log_softmax_backward_data", "_softmax_backward_data", "var_mean", "std_mean", "nll_loss_forward"}


def _fastest(tensor: torch.Tensor) -> int | None:
    """The dimension, counted from the last, that a tensor's memory runs fastest along (its smallest
    non-zero stride among dimensions longer than 1); None for a scalar-like or broadcast-only tensor."""
    best = None
    for back, (size, stride) in enumerate(zip(reversed(tensor.shape), reversed(tensor.stride()), strict=True)):
        if size > 1 and stride != 0 and (best is None or stride < best[1]):
            best = (back, stride)
    return None if best is None else best[0]


def layout_of(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], args: tuple) -> str:
    """How an elementwise, copy or gather kernel walks memory: "vectorised" (every operand contiguous and
    of one shape: vector loads), "transposed" (operands run fastest along different dimensions:
    uncoalesced accesses), "generic" (anything else: strided or broadcast operands, a widening cast, a
    reduction, a multi-tensor operation)."""
    if name.startswith("_foreach_") or name.startswith("_fused_") or name in REDUCTIONS:
        return "generic"
    if name in FILLS:
        operands = outputs
    elif name in GATHERS:
        source = args[0] if isinstance(args[0], torch.Tensor) else None
        operands = [t for t in ([source] if source is not None else []) + outputs]
    else:
        operands = inputs + outputs
    operands = [t for t in operands if t.numel() > 1 and (t.is_floating_point() or name in FILLS)]
    if not operands:
        return "vectorised"
    if name in GATHERS:   # rows gathered from a source whose rows are strided: uncoalesced
        source = operands[0]
        if source.dim() > 1 and source.shape[-1] > 1 and source.stride()[-1] != 1:
            return "transposed"
        return "vectorised" if all(t.is_contiguous() for t in operands) else "generic"
    largest = max(t.numel() for t in operands)
    full = [t for t in operands if t.numel() == largest
            and not any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride(), strict=True))]
    fastest = {_fastest(t) for t in full} - {None}   # broadcast operands aside
    if len(fastest) > 1:
        return "transposed"
    if name in ("cat", "stack"):
        return "vectorised" if all(t.is_contiguous() for t in operands) else "transposed"
    if len({tuple(t.shape) for t in operands}) > 1 or not all(t.is_contiguous() for t in operands):
        return "generic"
    if name in ("_to_copy", "copy_") and inputs and outputs and outputs[0].element_size() > inputs[0].element_size():
        return "generic"   # a widening cast (bf16 -> float32) runs unvectorised
    return "vectorised"


def mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes in place (its schema's mutable arguments: self of an in-place
    operation, out=, the lists a fused optimizer updates)."""
    mutated: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            mutated.extend(tensors(value))
    return mutated


def dtype_name(tensors: list[torch.Tensor]) -> str:
    floats = [t.dtype for t in tensors if t.is_floating_point()]
    dtype = floats[0] if floats else (tensors[0].dtype if tensors else None)
    return str(dtype).replace("torch.", "") if dtype is not None else ""


def gemm_shape(name: str, args: tuple, out: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matrix product; for a grouped product over jagged groups, the totals
    (batch 1, M the rows of every group, or K summed over groups)."""
    name = name.rstrip("_") if name in ("addmm_", "baddbmm_", "addbmm_") else name
    if name in ("mm", "_scaled_mm"):
        a, b = args[0], args[1]
        return 1, a.shape[0], b.shape[1], a.shape[1]
    if name == "addmm":
        a, b = args[1], args[2]
        return 1, a.shape[0], b.shape[1], a.shape[1]
    if name in ("bmm", "baddbmm", "addbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
    a, b = args[0], args[1]   # _grouped_mm(mat_a, mat_b, offs=...)
    if a.dim() == 2 and b.dim() == 3:           # jagged rows: (M_total, K) x (G, K, N)
        return 1, a.shape[0], b.shape[2], a.shape[1]
    if a.dim() == 3 and b.dim() == 2:           # (G, M, K) x (K, N_total)
        return 1, a.shape[1], b.shape[1], a.shape[2]
    if a.dim() == 2 and b.dim() == 2:           # jagged K: (M, K_total) x (K_total, N) -> (G, M, N)
        return 1, a.shape[0], b.shape[1], a.shape[1]
    return a.shape[0], a.shape[1], b.shape[2], a.shape[2]
