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


class _TargetCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, token_weights: torch.Tensor, chunk: int, transform: LogitTransform):
        count = hidden.shape[0]
        losses = torch.empty(count, dtype=torch.float32, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        cap = transform.softcap
        for start in range(0, count, chunk):
            end = min(start + chunk, count)
            logits = transform_logits(F.linear(hidden[start:end], weight, bias).float(), transform)
            log_norm = torch.logsumexp(logits, dim=-1)
            tgt = targets[start:end]
            losses[start:end] = log_norm - logits.gather(1, tgt[:, None]).squeeze(1)
            if need_grad:
                # d loss / d logits = softmax - one-hot;
                # d logits / d raw = slope, times (1 - (logits / cap)^2) under a soft-cap
                capped = logits.div(cap).square_().neg_().add_(1.0) if cap is not None else None
                probs = logits.sub_(log_norm[:, None]).exp_()
                probs[torch.arange(end - start, device=probs.device), tgt] -= 1.0
                probs.mul_(token_weights[start:end, None])
                if capped is not None:
                    probs.mul_(capped)
                    del capped
                if transform.slope != 1.0:
                    probs.mul_(transform.slope)
                grad_hidden[start:end] = (probs.to(weight.dtype) @ weight).to(hidden.dtype)
            del logits
        total = (losses * token_weights).sum()
        ctx.mark_non_differentiable(losses)
        if need_grad:
            ctx.save_for_backward(grad_hidden)
        return total, losses

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, grad_losses: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None, None


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
