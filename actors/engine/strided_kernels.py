"""RoPE and SwiGLU on projections that are columns of a wider row: the stacked q/k/v and gate/up outputs of
actors/engine/lora_siblings.py, whose layers' weights are rows of one tensor (actors/engine/sibling_weights.py).

Liger's functions copy any input that is not contiguous (`ensure_contiguous`, `.contiguous()`): two copies a layer
for q and k, two for gate and up, and for SwiGLU its input gradients then land in those copies, so the siblings'
backward concatenates them again. Here the same work is done where the columns lie:
- `rope`: Liger's own RoPE kernel (`_triton_rope`, which takes each tensor's row stride) launched on the query and
  key as they lie (token-major: heads × head dim contiguous in each token's row, one sequence), rotated in place as
  Liger's function rotates its contiguous input; anything else goes to Liger's function;
- `swiglu`: silu(gate) · up by a Triton kernel of its own that takes each operand's row stride, in the arithmetic of
  Liger's SwiGLU kernel (silu in float32, rounded to the input's dtype, times up), computed again in the backward, whose
  gradients are written over the saved gate and up columns (as Liger's are over its copies), so that the siblings'
  backward finds them side by side (`lora_siblings.side_by_side`); contiguous operands go to Liger's function.
`swiglu_reference` is the same arithmetic in torch, for reading and for the tests."""

from __future__ import annotations

import torch

from actors.engine.triton_support import cdiv, next_power_of_2, tl, triton

# the arguments of Liger's RoPE kernel this module launches it with (liger-kernel 0.8); another signature: Liger's own
ROPE_ARGUMENTS = ("q_ptr", "q_row_stride", "k_ptr", "k_row_stride", "cos", "cos_row_stride", "sin", "sin_row_stride",
                  "sl", "bs", "cos_bs", "n_qh", "n_kh", "hd", "pad_n_qh", "pad_n_kh", "pad_hd", "pad_rd", "rd",
                  "BLOCK_SIZE", "BACKWARD_PASS")
SWIGLU_BLOCK = 1024   # columns a program takes (Liger's column tile on wide rows)


def _liger_rope_kernel():
    from liger_kernel.ops import rope

    kernel = getattr(rope, "_triton_rope", None)
    return kernel if kernel is not None and tuple(getattr(kernel, "arg_names", ())) == ROPE_ARGUMENTS else None


def _token_rows(tensor: torch.Tensor) -> bool:
    """A (1, tokens, heads, dim) tensor whose every token's heads lie contiguous in memory (its rows may be wider)."""
    return (tensor.dim() == 4 and tensor.shape[0] == 1 and tensor.stride(-1) == 1
            and tensor.stride(-2) == tensor.shape[-1])


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids=None,
         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Liger's `liger_rope` (q: (1, heads, T, dim), k: (1, kv heads, T, dim)), rotating columns of a wider row where
    they lie."""
    from liger_kernel.transformers.functional import liger_rope

    rows_q, rows_k = q.transpose(1, 2), k.transpose(1, 2)
    if (rows_q.is_contiguous() and rows_k.is_contiguous()) or not (_token_rows(rows_q) and _token_rows(rows_k)) \
            or cos.shape[-1] != q.shape[-1] or _liger_rope_kernel() is None:
        return liger_rope(q, k, cos, sin, position_ids, unsqueeze_dim)
    return _RowRope.apply(q, k, *_rows_of(cos, sin))


def _rows_of(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as the kernel reads them: (batch, T, dim), contiguous (as Liger's function shapes them)."""
    if cos.dim() == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos.contiguous(), sin.contiguous()


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> None:
    """Rotate (1, T, heads, dim) q and k in place (their rows `_token_rows`; cos and sin `_rows_of`; the inverse
    rotation for `backward`)."""
    _, tokens, q_heads, dim = q.shape
    k_heads = k.shape[2]
    power = next_power_of_2
    _liger_rope_kernel()[(tokens,)](
        q, q.stride(1), k, k.stride(1), cos, cos.stride(-2), sin, sin.stride(-2), tokens, 1, cos.shape[0], q_heads,
        k_heads, dim, power(q_heads), power(k_heads), power(dim), power(dim), dim,
        BLOCK_SIZE=max(power(q_heads), power(k_heads)), BACKWARD_PASS=backward)


class _RowRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        rows_q, rows_k = q.transpose(1, 2), k.transpose(1, 2)
        _rotate(rows_q, rows_k, cos, sin, backward=False)
        ctx.save_for_backward(cos, sin)
        return rows_q.transpose(1, 2), rows_k.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        rows_q, rows_k = grad_q.transpose(1, 2), grad_k.transpose(1, 2)
        rows_q = rows_q if _token_rows(rows_q) else rows_q.contiguous()
        rows_k = rows_k if _token_rows(rows_k) else rows_k.contiguous()
        _rotate(rows_q, rows_k, cos, sin, backward=True)
        return rows_q.transpose(1, 2), rows_k.transpose(1, 2), None, None


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in torch: silu in float32, rounded to the input's dtype, times up."""
    return torch.nn.functional.silu(gate.float()).to(up.dtype) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up: Liger's function on contiguous operands, the row-strided kernel on columns of wider rows."""
    from liger_kernel.transformers.functional import liger_swiglu

    if (gate.is_contiguous() and up.is_contiguous()) or not _rows(gate) or not _rows(up) or gate.shape != up.shape:
        return liger_swiglu(gate, up)
    return _RowSwiglu.apply(gate, up)


def _rows(tensor: torch.Tensor) -> bool:
    """Whether the tensor is one run of rows, each contiguous within itself (its rows may be wider)."""
    if tensor.stride(-1) != 1:
        return False
    try:
        tensor.view(-1, tensor.shape[-1])
    except RuntimeError:   # leading dimensions that are not one run of rows
        return False
    return True


class _RowSwiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        a, b = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
        out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        rows, cols = a.shape
        _swiglu_forward[(rows, cdiv(cols, SWIGLU_BLOCK))](a, b, out, a.stride(0), b.stride(0), out.stride(0),
                                                                 cols, BLOCK=SWIGLU_BLOCK)
        ctx.save_for_backward(gate, up)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        a, b = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
        grad = grad_out.reshape(a.shape)
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        rows, cols = a.shape
        _swiglu_backward[(rows, cdiv(cols, SWIGLU_BLOCK))](grad, a, b, grad.stride(0), a.stride(0),
                                                                  b.stride(0), cols, BLOCK=SWIGLU_BLOCK)
        return gate, up   # the gradients, written over the saved operands


if triton is not None:
    @triton.jit
    def _swiglu_forward(a_ptr, b_ptr, out_ptr, a_stride, b_stride, out_stride, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < cols
        a = tl.load(a_ptr + row * a_stride + offsets, mask=mask, other=0).to(tl.float32)
        b = tl.load(b_ptr + row * b_stride + offsets, mask=mask, other=0)
        out = (a * tl.sigmoid(a)).cast(b.dtype) * b
        tl.store(out_ptr + row * out_stride + offsets, out, mask=mask)

    @triton.jit
    def _swiglu_backward(grad_ptr, a_ptr, b_ptr, grad_stride, a_stride, b_stride, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < cols
        grad = tl.load(grad_ptr + row * grad_stride + offsets, mask=mask, other=0)
        a = tl.load(a_ptr + row * a_stride + offsets, mask=mask, other=0).to(tl.float32)
        b = tl.load(b_ptr + row * b_stride + offsets, mask=mask, other=0)
        sigmoid = tl.sigmoid(a)
        silu = a * sigmoid
        grad_b = grad * silu
        grad_a = grad * (silu * (1 - sigmoid) + sigmoid) * b
        tl.store(a_ptr + row * a_stride + offsets, grad_a, mask=mask)
        tl.store(b_ptr + row * b_stride + offsets, grad_b, mask=mask)
