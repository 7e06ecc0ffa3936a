"""Cross-entropy at target positions only, in chunks, with the gradient computed in the forward pass.

The frozen LM head needs no weight gradient, so each chunk's logits are made, turned into the loss and
the gradient with respect to the hidden states, and freed: tokens x vocabulary logits never exist whole,
and backward only scales the stored (targets x hidden) gradient. A model's logit transform (Granite's
logits_scaling, Cohere's logit_scale, Gemma's final soft-cap; actors/engine/model_support.py) is applied
to each chunk in float32, its derivative folded into the stored gradient.

With `kernels: liger` (actors/engine/kernels.py marks the LM head's weight: `use_fused_loss`), each chunk's
logits stay in the base's dtype and Liger-Kernel's cross-entropy kernel turns them, row by row and in place,
into each target's loss (float32) and d loss / d logits (softmax - one-hot, through the soft-cap where the model
has one): no float32 chunk of logits is made, and there is no host synchronisation. The per-token weights and a
logit scaling (Granite, Cohere) are applied as here: the weights to each row of the (targets x hidden)
gradient in float32, the scaling to the hidden states before the head (logits = (hidden * slope) @ W^T + bias *
slope). The same chunks, the same autograd functions, the same (sum, per-token losses) results; Liger's own
`LigerFusedLinearCrossEntropyFunction` is not used: with per-token losses (`reduction="none"`) it recomputes the
logits in backward (a third head GEMM) and its forward reads the target count back to the host (`.item()`).
Isolation: one target's row at a time, as here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.engine.model_support import LogitTransform

DEFAULT_CHUNK = 1024
IDENTITY = LogitTransform()
FUSED_LOSS_ATTRIBUTE = "_aspen_fused_loss"
FUSED_LOSSES = ("liger",)


def use_fused_loss(head_weight: torch.Tensor, kernel: str) -> None:
    """Compute the loss of the LM head whose weight is `head_weight` with `kernel` (FUSED_LOSSES): the mark
    lives on that model's weight, so another model in the process keeps the chunked float32 loss."""
    if kernel not in FUSED_LOSSES:
        raise ValueError(f"fused loss kernel must be one of {', '.join(FUSED_LOSSES)}, not '{kernel}'")
    setattr(head_weight, FUSED_LOSS_ATTRIBUTE, kernel)


def fused_loss(head_weight: torch.Tensor) -> str | None:
    """The fused loss kernel marked on this LM head's weight, or None."""
    return getattr(head_weight, FUSED_LOSS_ATTRIBUTE, None)


def transform_logits(raw: torch.Tensor, transform: LogitTransform, *, inplace: bool = True) -> torch.Tensor:
    """The model's logits from the LM head's output (float32, modified in place where it can be; `inplace=False`:
    a new tensor, differentiable, as an adapted head's loss needs: actors/engine/head_lora.py)."""
    logits = raw
    if transform.multiply != 1.0:
        logits = logits.mul_(transform.multiply) if inplace else logits * transform.multiply
    if transform.divide != 1.0:
        logits = logits.div_(transform.divide) if inplace else logits / transform.divide
    if transform.softcap is not None:
        cap = transform.softcap
        logits = logits.div_(cap).tanh_().mul_(cap) if inplace else torch.tanh(logits / cap) * cap
    return logits


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           scale: torch.Tensor | None, transform: LogitTransform, need_grad: bool
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's per-token losses (float32) and, with `need_grad`, their gradient with respect to the
    chunk's hidden states, each row times its `scale` (None: unscaled)."""
    if fused_loss(weight) == "liger":
        return _liger_chunk(hidden, weight, bias, targets, scale, transform, need_grad)
    cap = transform.softcap
    logits = transform_logits(F.linear(hidden, weight, bias).float(), transform)
    log_norm = torch.logsumexp(logits, dim=-1)
    losses = log_norm - logits.gather(1, targets[:, None]).squeeze(1)
    if not need_grad:
        return losses, None
    # d loss / d logits = softmax - one-hot;
    # d logits / d raw = slope, times (1 - (logits / cap)^2) under a soft-cap
    capped = logits.div(cap).square_().neg_().add_(1.0) if cap is not None else None
    probs = logits.sub_(log_norm[:, None]).exp_()
    probs[torch.arange(hidden.shape[0], device=probs.device), targets] -= 1.0
    if scale is not None:
        probs.mul_(scale[:, None])
    if capped is not None:
        probs.mul_(capped)
        del capped
    if transform.slope != 1.0:
        probs.mul_(transform.slope)
    return losses, (probs.to(weight.dtype) @ weight).to(hidden.dtype)


def _liger_chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 scale: torch.Tensor | None, transform: LogitTransform, need_grad: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_chunk` through Liger-Kernel's cross-entropy kernel (module docstring): the logits in the head's dtype,
    overwritten in place by d loss / d logits; the kernel's reductions off (`reduction="none"`, no class weights,
    no label smoothing, no z-loss, no target ignored: every row is a target)."""
    import triton
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    from liger_kernel.ops.fused_linear_cross_entropy import MAX_FUSED_SIZE
    from liger_kernel.ops.utils import is_hip

    slope = transform.slope
    scaled = hidden if slope == 1.0 else hidden * slope
    scaled_bias = bias if bias is None or slope == 1.0 else bias * slope
    logits = F.linear(scaled, weight, scaled_bias).contiguous()
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=hidden.device)
    targets = targets.contiguous()
    liger_cross_entropy_kernel[(rows,)](
        X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=targets, Y_stride=targets.stride(-1), weight_ptr=None,
        loss_ptr=losses, z_loss_ptr=None, loss_stride=losses.stride(-1), token_accuracy_ptr=None,
        token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=vocab,
        n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=-100, lse_square_scale=0.0,
        label_smoothing=0.0, reduction="none", softcap=transform.softcap, RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False, HAS_WEIGHT=False,
        HAS_SOFTCAPPING=transform.softcap is not None, HAS_GRADIENTS=need_grad,
        BLOCK_SIZE=min(MAX_FUSED_SIZE, triton.next_power_of_2(vocab)), num_warps=16 if is_hip() else 32)
    if not need_grad:
        return losses, None
    grad = logits @ weight   # d loss / d (hidden * slope), each row unscaled
    if scale is None and slope == 1.0:
        return losses, grad.to(hidden.dtype)
    grad = grad.float()
    if scale is not None:
        grad.mul_(scale[:, None])
    if slope != 1.0:
        grad.mul_(slope)
    return losses, grad.to(hidden.dtype)


def _chunked(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
             scale: torch.Tensor | None, chunk: int, transform: LogitTransform, need_grad: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every target's loss (float32) and, with `need_grad`, the (targets x hidden) gradient, `chunk` rows at
    a time (`_chunk`): the logits never exist whole."""
    count = hidden.shape[0]
    losses = torch.empty(count, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    for start in range(0, count, chunk):
        end = min(start + chunk, count)
        losses[start:end], grad = _chunk(hidden[start:end], weight, bias, targets[start:end],
                                         None if scale is None else scale[start:end], transform, need_grad)
        if need_grad:
            grad_hidden[start:end] = grad
        del grad
    return losses, grad_hidden


class _TargetCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, token_weights: torch.Tensor, chunk: int, transform: LogitTransform):
        need_grad = ctx.needs_input_grad[0]
        losses, grad_hidden = _chunked(hidden, weight, bias, targets, token_weights, chunk, transform, need_grad)
        total = (losses * token_weights).sum()
        ctx.mark_non_differentiable(losses)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        return total, losses

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, grad_losses: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


class _TargetLogProbs(torch.autograd.Function):
    """Per-token log-probabilities of the targets, differentiable one by one: the forward keeps each
    token's own gradient (targets x hidden, as the cross-entropy does) and the backward scales each row
    by the incoming gradient of its log-probability, so any function of them (a sequence's sum, DPO's
    sigmoid of sums) backpropagates through the chunked head without the logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, chunk: int, transform: LogitTransform):
        need_grad = ctx.needs_input_grad[0]
        losses, grad_hidden = _chunked(hidden, weight, bias, targets, None, chunk, transform, need_grad)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        return losses.neg_()

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors   # d loss / d hidden; log-probability = -loss
        return grad_hidden * grad_log_probs.neg().to(grad_hidden.dtype)[:, None], None, None, None, None, None


def target_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     chunk: int = DEFAULT_CHUNK, transform: LogitTransform = IDENTITY) -> torch.Tensor:
    """(M,) float32 log-probabilities of `targets` under the head's logits at `hidden` (M, d), each
    differentiable with respect to `hidden` (the preference losses: actors/engine/preference.py)."""
    if hidden.shape[0] == 0:
        return hidden.sum(dim=-1).float() * 0.0
    return _TargetLogProbs.apply(hidden, weight, bias, targets, chunk, transform)


def target_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, token_weights: torch.Tensor, chunk: int = DEFAULT_CHUNK,
                         transform: LogitTransform = IDENTITY) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sum of token_weights * per-token loss, differentiable; per-token losses, detached).

    hidden: (M, d) final hidden states at target positions; weight: (V, d) frozen LM head; transform: the
    model's logit transform after the head (model_support.check_model_support)."""
    if hidden.shape[0] == 0:
        zero = hidden.sum() * 0.0
        return zero, torch.empty(0, dtype=torch.float32, device=hidden.device)
    return _TargetCrossEntropy.apply(hidden, weight, bias, targets, token_weights.float(), chunk, transform)


def logits_transient_bytes(chunk: int, vocab_size: int, count: int, softcapped: bool = False, *,
                           fused: str | None = None, element_bytes: int = 2) -> int:
    """Largest transient of the loss: one chunk of float32 logits and its softmax (computed in place), and
    with a soft-cap one more chunk (the cap's derivative). With a fused loss (`fused`: the head weight's
    `fused_loss`), one chunk of logits in the head's dtype (`element_bytes` each), overwritten in place by
    their gradient."""
    if fused is not None:
        return min(chunk, count) * vocab_size * element_bytes
    return min(chunk, count) * vocab_size * 4 * (3 if softcapped else 2)
