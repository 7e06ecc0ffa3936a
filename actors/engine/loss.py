"""Cross-entropy at target positions only, in chunks, with the gradient computed in the forward pass.

The frozen LM head needs no weight gradient, so each chunk's logits are made, turned into the loss and
the gradient with respect to the hidden states, and freed: tokens x vocabulary logits never exist whole,
and backward only scales the stored (targets x hidden) gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 1024


class _TargetCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, token_weights: torch.Tensor, chunk: int):
        count = hidden.shape[0]
        losses = torch.empty(count, dtype=torch.float32, device=hidden.device)
        need_grad = ctx.needs_input_grad[0]
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        for start in range(0, count, chunk):
            end = min(start + chunk, count)
            logits = F.linear(hidden[start:end], weight, bias).float()
            log_norm = torch.logsumexp(logits, dim=-1)
            tgt = targets[start:end]
            losses[start:end] = log_norm - logits.gather(1, tgt[:, None]).squeeze(1)
            if need_grad:
                probs = logits.sub_(log_norm[:, None]).exp_()
                probs[torch.arange(end - start, device=probs.device), tgt] -= 1.0
                probs.mul_(token_weights[start:end, None])
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
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None


def target_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, token_weights: torch.Tensor,
                         chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sum of token_weights * per-token loss, differentiable; per-token losses, detached).

    hidden: (M, d) final hidden states at target positions; weight: (V, d) frozen LM head."""
    if hidden.shape[0] == 0:
        zero = hidden.sum() * 0.0
        return zero, torch.empty(0, dtype=torch.float32, device=hidden.device)
    return _TargetCrossEntropy.apply(hidden, weight, bias, targets, token_weights.float(), chunk)


def logits_transient_bytes(chunk: int, vocab_size: int, count: int) -> int:
    """Largest transient of the loss: one chunk of float32 logits and its softmax (computed in place)."""
    return min(chunk, count) * vocab_size * 4 * 2
