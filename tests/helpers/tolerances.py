"""Tolerances derived from the arithmetic, for comparing two computations of the same quantity whose sums run
in different orders: aspen against TRL, PEFT or Hugging Face's Trainer, one layout against another. Such a
comparison must hold on any CPU (MKL and oneDNN choose their kernels, and so their summation orders, by CPU:
the next machine may be Intel or AMD) and still fail on a wrong result. (Where the arithmetic is the same, the
tests assert equality instead: tests/unit/engine/test_isolation.py says why that is exact on the CPU.)

Rounding of sums. Each floating-point operation rounds its exact result r to r(1 + d), |d| <= u, the unit
roundoff: 2^-24 for float32 (`torch.finfo(torch.float32).eps` is 2^-23 = 2u). A sum of n terms, in any order,
is then within γ(n-1)·Σ|x_i| of the exact sum, γ(k) = k·u / (1 - k·u) [Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., §3.1, §4.2], and a value computed through a chain of sums (a forward and a
backward pass: dot products over the hidden size, sums over keys, the vocabulary, the tokens of a step)
carries, to first order, the sum of its links' relative errors: n is the number of terms summed along the
longest chain (`llama_chain_terms`). That worst case needs every rounding to go the same way; the d's of
different operations are in practice independent and of mean zero, so the error is a random walk whose
standard deviation is at most √n·u times the magnitude [Higham §2.8]. Two computations in two orders differ by
a difference of two such walks, of standard deviation √(2n)·u·magnitude: the tolerance is 6 of those
(`rounding_tolerance`: a Gaussian beyond 6σ has probability 2e-9 per compared value), and never more than
the worst case 2·γ(n)·magnitude.
The magnitude is that of the results compared (the largest entry of a gradient, the sum of a sequence's
log-probabilities, which are all <= 0, so that their sum is as large as its terms): a result whose terms cancel
far below the magnitude of the results beside it is the exception this leaves out.

AdamW. An optimizer step turns a gradient entry g into lr·g/(|g|+ε) (first step; later steps divide by
√v̂ + ε likewise): the derivative ε/(|g|+ε)² reaches 1/ε = 1e8 near g = 0, so a rounding difference δ in an
entry close to zero moves its weight by up to lr·δ·ε/(|g|-δ+ε)², up to 2·lr for |g| <= δ. Weights after AdamW
steps are therefore compared either through the gradients that produced them (from the same state), or with
that bound per entry (`adamw_first_step_bound`), never with one fixed tolerance."""

from __future__ import annotations

import math

import torch

ADAMW_EPS = 1e-8   # torch.optim.AdamW's default, which aspen and the references use


SIGMAS = 6


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def rounding_tolerance(terms: int, magnitude: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of the same chain of `terms` summed terms, in two orders, may fall apart, for
    results of `magnitude`: 6·√(2·terms)·u·magnitude, at most the worst case 2·γ(terms)·magnitude."""
    u = unit_roundoff(dtype)
    assert terms * u < 0.5, f"{terms} terms: the rounding bound does not apply"
    worst = 2 * terms * u / (1 - terms * u)
    return min(SIGMAS * math.sqrt(2 * terms) * u, worst) * magnitude


def llama_chain_terms(config, *, sequence: int, tokens: int, backward: bool = True) -> int:
    """Terms summed along the longest chain from a token to a LoRA weight's gradient in a llama-style model
    (`config`: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size), for
    sequences of at most `sequence` tokens, and `tokens` terms in the last sum (a gradient's: every token of
    the micro-batch; a sequence's log-probability: its tokens). Per layer forward: two RMS norms (hidden each),
    a projection (hidden), attention scores (head_dim), the softmax's denominator and the weighted values
    (sequence each), o_proj (hidden), gate/up (hidden), down (intermediate); then the final norm, the head
    (hidden) and the log-softmax (vocabulary). The backward pass (`backward`) runs the same sums again."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    layer = 2 * hidden + hidden + head_dim + 2 * sequence + hidden + hidden + config.intermediate_size
    forward = layers * layer + 2 * hidden + config.vocab_size
    return (2 if backward else 1) * forward + tokens


ADAMW_ROUNDINGS = 8   # the moments, their bias corrections, the square root, + eps, the division, · lr, the subtraction


def adamw_first_step_bound(gradient: torch.Tensor, delta: float, lr: float, weight: torch.Tensor,
                           eps: float = ADAMW_EPS) -> torch.Tensor:
    """Per entry, the most the weights `weight` after AdamW's first update (lr·g/(|g|+ε)) can differ between
    two computations: of the gradient `gradient`, differing by at most `delta` per entry, lr·δ·ε/(max(|g|-δ,
    0)+ε)² (at most 2·lr); and of the update itself, by two AdamW kernels, its ADAMW_ROUNDINGS roundings of
    at most u times the weight or the update each (float32)."""
    nearest = (gradient.abs().double() - delta).clamp(min=0)
    from_gradient = (lr * delta * eps / (nearest + eps) ** 2).clamp(max=2 * lr)
    return from_gradient + 2 * ADAMW_ROUNDINGS * unit_roundoff() * (weight.abs().double() + lr)
