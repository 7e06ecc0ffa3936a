"""The Tinker API's loss functions, token by token, as its SDK documents them: each takes the model's
log-probabilities of a datum's target tokens (`target_logprobs`, shape (N,), differentiable), the datum's
`loss_fn_inputs` (tensors of shape (N,)) and the call's `loss_fn_config`, and returns the elementwise loss
(N,). cross_entropy also takes K targets a position (top-k distillation): target_tokens and weights (N, K),
its log-probabilities and elementwise loss (N, K), -sum over t, k of w[t, k] log p(x[t, k]). A call's loss is
the plain sum of its datums' elementwise losses: Tinker sums over tokens and datums and never takes a mean
(aspen's own jobs do: the mean over a job's target tokens).

- cross_entropy: -target_logprobs * weights
- importance_sampling: -exp(target_logprobs - logprobs) * advantages (`logprobs`: the sampler's)
- ppo: -min(ratio * A, clamp(ratio, clip_low_threshold, clip_high_threshold) * A), bounds 0.8 and 1.2
- cispo: -clamp(ratio, low, high).detach() * target_logprobs * A, bounds 0.0 and 4.0
- dro: -(target_logprobs * A - beta / 2 * (target_logprobs - logprobs) ** 2), `beta` required
- gspo (GSPO-token, Zheng et al. 2025): PPO's objective with every token's ratio the sequence's, the geometric mean
  of the ratios over the tokens `sequence_ratio_mask` marks (without one, those with a non-zero advantage: the
  sampled ones, as tinker-cookbook's RL datums carry no mask; none: the datum adds nothing), each token with its own
  log-probability's gradient; bounds 1 - 3e-4 and 1 + 4e-4 by default (the paper's clipping ranges: Tinker's
  documentation gives no default)

The reinforcement-learning losses read `weights` nowhere (as the SDK's documented code): advantages are
what masks a prompt's tokens (0 there)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Tensor = torch.Tensor
LossFunction = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]

# each loss function's loss_fn_inputs beside target_tokens, and its config keys with their defaults
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}
OPTIONAL: dict[str, tuple[str, ...]] = {"gspo": ("sequence_ratio_mask",)}   # read where given
CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
}


class LossInputError(ValueError):
    """A call's loss function, inputs or config that cannot be computed; the message names which."""


def cross_entropy(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    return -target_logprobs * inputs["weights"]


def importance_sampling(target_logprobs: Tensor, inputs: Mapping[str, Tensor],
                        config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"])


def ppo(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    advantages = inputs["advantages"]
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


def cispo(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(target_logprobs - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(clipped * target_logprobs * inputs["advantages"])


def dro(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    drift = target_logprobs - inputs["logprobs"]
    return -(target_logprobs * inputs["advantages"] - 0.5 * config["beta"] * drift * drift)


def gspo(target_logprobs: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    advantages = inputs["advantages"]
    mask = inputs.get("sequence_ratio_mask")
    # without a mask, the tokens that carry the sequence's advantage: its sampled ones (a prompt's have none), as
    # tinker-cookbook's RL datums, which send no mask, are built
    in_ratio = mask != 0 if mask is not None else advantages != 0
    if not bool(in_ratio.any()):   # no advantage anywhere (a group whose rewards were equal): nothing to learn
        return target_logprobs * 0.0
    log_ratio = (target_logprobs.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())   # the sequence's value, own gradient
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages)


LOSS_FUNCTIONS: dict[str, LossFunction] = {"cross_entropy": cross_entropy,
                                           "importance_sampling": importance_sampling, "ppo": ppo,
                                           "cispo": cispo, "dro": dro, "gspo": gspo}


def loss_config(loss_fn: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """The call's config with the loss function's defaults filled in; unknown keys and missing required
    ones refused, naming them."""
    if loss_fn not in LOSS_FUNCTIONS:
        raise LossInputError(f"loss_fn '{loss_fn}' is not one aspen computes; use one of "
                             f"{', '.join(LOSS_FUNCTIONS)} (or forward_backward_custom)")
    known = CONFIG[loss_fn]
    unknown = sorted(set(given or {}) - set(known))
    if unknown:
        raise LossInputError(f"loss_fn_config {unknown} is not a setting of {loss_fn}"
                             + (f" (its settings: {', '.join(known)})" if known else " (it takes none)"))
    config = {**known, **(given or {})}
    missing = sorted(key for key, value in config.items() if value is None)
    if missing:
        raise LossInputError(f"{loss_fn} needs loss_fn_config {missing}")
    return {key: float(value) for key, value in config.items()}


def check_inputs(loss_fn: str, inputs: Mapping[str, Tensor], length: int, datum: int) -> None:
    """Each input the loss function reads is present with one value per input token: shape (N,), or for
    cross_entropy (top-k distillation) target_tokens and weights of one shape (N, K), K targets a position."""
    for name in ("target_tokens", *INPUTS[loss_fn]):
        if name not in inputs:
            raise LossInputError(f"datum {datum}: loss_fn_inputs lacks '{name}', which {loss_fn} reads")
    if loss_fn == "gspo" and "sequence_ratio_mask" in inputs and inputs["sequence_ratio_mask"].shape == (length,) \
            and not bool((inputs["sequence_ratio_mask"] != 0).any()):
        raise LossInputError(f"datum {datum}: sequence_ratio_mask marks no token, so gspo has no sequence ratio; mark "
                             "the sampled tokens (1 there)")
    shape = tuple(inputs["target_tokens"].shape)
    top_k = loss_fn == "cross_entropy" and len(shape) == 2 and shape[0] == length and shape[1] >= 1
    for name in ("target_tokens", *INPUTS[loss_fn], *(n for n in OPTIONAL.get(loss_fn, ()) if n in inputs)):
        if tuple(inputs[name].shape) != (shape if top_k else (length,)):
            wanted = f"target_tokens' {shape}" if top_k else f"one value per model_input token ({length},)"
            raise LossInputError(f"datum {datum}: loss_fn_inputs '{name}' has shape {tuple(inputs[name].shape)}; "
                                 f"it needs {wanted}" + ("" if loss_fn != "cross_entropy" else
                                                         " (or (N, K) top-k targets with weights of that shape)"))
