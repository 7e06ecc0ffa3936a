"""Cross-entropy at target positions only, in chunks, with the gradient computed in the forward pass.

The frozen LM head needs no weight gradient, so each chunk's logits are made, turned into the loss and
the gradient with respect to the hidden states, and freed: tokens x vocabulary logits never exist whole,
and backward only scales the stored (targets x hidden) gradient. A model's logit transform (Granite's
logits_scaling, Cohere's logit_scale, Gemma's final soft-cap; actors/engine/model_support.py) is applied
to each chunk in float32, its derivative folded into the stored gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from actors.engine.model_support import LogitTransform

DEFAULT_CHUNK = 1024
IDENTITY = LogitTransform()


def transform_logits(raw: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """The model's logits from the LM head's output (float32, modified in place where it can be)."""
    logits = raw
    if transform.multiply != 1.0:
        logits = logits.mul_(transform.multiply)
    if transform.divide != 1.0:
        logits = logits.div_(transform.divide)
    if transform.softcap is not None:
        logits = logits.div_(transform.softcap).tanh_().mul_(transform.softcap)
    return logits


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           scale: torch.Tensor | None, transform: LogitTransform, need_grad: bool
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's per-token losses (float32) and, with `need_grad`, their gradient with respect to the
    chunk's hidden states, each row times its `scale` (None: unscaled)."""
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


def logits_transient_bytes(chunk: int, vocab_size: int, count: int, softcapped: bool = False) -> int:
    """Largest transient of the loss: one chunk of float32 logits and its softmax (computed in place), and
    with a soft-cap one more chunk (the cap's derivative)."""
    return min(chunk, count) * vocab_size * 4 * (3 if softcapped else 2)
