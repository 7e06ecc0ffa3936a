"""The Tinker API's loss functions (actors/engine/tinker_losses.py) against hand-computed values on fixed
log-probabilities, sampling log-probabilities and advantages: the losses, and their gradients with respect to
the model's log-probabilities (what flows back into the adapters), worked out by hand from the SDK's
definitions (ratio r = exp(lp - q); ppo's min of the clipped and unclipped terms; cispo's detached clip; gspo's
sequence ratio)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.engine.tinker_losses import LOSS_FUNCTIONS, LossInputError, check_inputs, loss_config

pytestmark = pytest.mark.unit

LP = [-1.0, -0.5, -2.0, -0.1]          # the model's log-probabilities of the targets
Q = [-1.2, -0.5, -1.0, -0.9]           # the sampler's
A = [1.0, -2.0, 0.5, 3.0]              # advantages


def run(loss_fn: str, config: dict | None = None) -> tuple[list[float], list[float]]:
    logprobs = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(A, dtype=torch.float64),
              "weights": torch.tensor([0.0, 1.0, 1.0, 0.5], dtype=torch.float64)}
    loss = LOSS_FUNCTIONS[loss_fn](logprobs, inputs, loss_config(loss_fn, config))
    loss.sum().backward()
    return loss.tolist(), logprobs.grad.tolist()


def test_cross_entropy_is_the_weighted_negative_log_likelihood():
    loss, grad = run("cross_entropy")
    assert loss == pytest.approx([0.0, 0.5, 2.0, 0.05], abs=1e-15)
    assert grad == pytest.approx([-0.0, -1.0, -1.0, -0.5], abs=1e-15)


def test_importance_sampling_weighs_advantages_by_the_ratio():
    loss, grad = run("importance_sampling")
    ratios = [math.exp(lp - q) for lp, q in zip(LP, Q, strict=True)]
    assert loss == pytest.approx([-r * a for r, a in zip(ratios, A, strict=True)], rel=1e-14)
    # d(-r A)/d lp = -r A
    assert grad == pytest.approx([-r * a for r, a in zip(ratios, A, strict=True)], rel=1e-14)


def test_ppo_takes_the_pessimistic_term_and_stops_the_gradient_where_clipped():
    loss, grad = run("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    ratios = [math.exp(lp - q) for lp, q in zip(LP, Q, strict=True)]   # 1.221, 1, 0.368, 2.226
    # token 0: A > 0, r above 1.1: min(rA, 1.1A) = 1.1A, clipped: no gradient
    # token 1: r = 1 inside the range: -rA, gradient -rA
    # token 2: A > 0, r below 0.9: min(rA, 0.9A) = rA, unclipped: gradient -rA
    # token 3: A > 0, r above 1.1: 1.1A, no gradient
    expected = [-1.1 * A[0], -ratios[1] * A[1], -ratios[2] * A[2], -1.1 * A[3]]
    assert loss == pytest.approx(expected, rel=1e-14)
    assert grad == pytest.approx([0.0, -ratios[1] * A[1], -ratios[2] * A[2], 0.0], abs=1e-14)


def test_ppo_defaults_are_0_8_and_1_2():
    assert loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_cispo_weighs_the_log_likelihood_by_the_detached_clipped_ratio():
    loss, grad = run("cispo")   # bounds 0 and 4: no ratio here is clipped
    ratios = [math.exp(lp - q) for lp, q in zip(LP, Q, strict=True)]
    assert loss == pytest.approx([-r * lp * a for r, lp, a in zip(ratios, LP, A, strict=True)], rel=1e-14)
    # the ratio is detached: d/d lp = -clip(r) A
    assert grad == pytest.approx([-r * a for r, a in zip(ratios, A, strict=True)], rel=1e-14)
    _, clipped = run("cispo", {"clip_high_threshold": 1.0})
    assert clipped[0] == pytest.approx(-1.0 * A[0], rel=1e-14) and clipped[3] == pytest.approx(-1.0 * A[3])


def test_dro_penalises_the_squared_drift():
    loss, grad = run("dro", {"beta": 0.5})
    expected = [-(lp * a - 0.25 * (lp - q) ** 2) for lp, q, a in zip(LP, Q, A, strict=True)]
    assert loss == pytest.approx(expected, rel=1e-14)
    assert grad == pytest.approx([-(a - 0.5 * (lp - q)) for lp, q, a in zip(LP, Q, A, strict=True)], rel=1e-14)


def test_gspo_gives_every_token_the_sequences_ratio_and_its_own_gradient():
    """GSPO-token as Tinker documents it: s = exp(mean over the masked tokens of lp - q), every token's ratio s in
    value with d ratio / d lp = s; PPO's pessimistic min with the clipped s (the paper's bounds by default)."""
    logprobs = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    mask = [0.0, 1.0, 1.0, 1.0]   # token 0 is the prompt's: outside the sequence ratio
    inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.tensor(A, dtype=torch.float64),
              "sequence_ratio_mask": torch.tensor(mask, dtype=torch.float64)}
    config = loss_config("gspo", None)
    assert config == pytest.approx({"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}, rel=1e-15)
    loss = LOSS_FUNCTIONS["gspo"](logprobs, inputs, config)
    loss.sum().backward()
    s = math.exp(sum(lp - q for lp, q, m in zip(LP, Q, mask, strict=True) if m) / 3)   # 0.9355: below the low bound
    low = 1 - 3e-4
    # A > 0: min(sA, low A) = sA, unclipped, gradient -sA; A < 0 (token 1): min(sA, low A) = low A, clipped: none
    assert loss.tolist() == pytest.approx([-s * A[0], -low * A[1], -s * A[2], -s * A[3]], rel=1e-14)
    assert logprobs.grad.tolist() == pytest.approx([-s * A[0], 0.0, -s * A[2], -s * A[3]], abs=1e-14)


def test_gspo_without_a_mask_takes_the_ratio_over_the_tokens_with_an_advantage():
    """tinker-cookbook's RL datums (rl/train.py's math_rl with loss_fn gspo) carry no sequence_ratio_mask: the ratio is
    then over the tokens whose advantage is not zero (the sampled ones; a prompt's are 0), the same loss as with that
    mask given; a datum without any advantage (a group whose rewards were equal) adds nothing, not a NaN."""
    advantages = [0.0, -2.0, 0.5, 3.0]   # token 0 is the prompt's
    config = loss_config("gspo", None)
    losses, grads = [], []
    for mask in ([0.0, 1.0, 1.0, 1.0], None):
        logprobs = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
        inputs = {"logprobs": torch.tensor(Q, dtype=torch.float64),
                  "advantages": torch.tensor(advantages, dtype=torch.float64),
                  **({} if mask is None else {"sequence_ratio_mask": torch.tensor(mask, dtype=torch.float64)})}
        check_inputs("gspo", {"target_tokens": torch.zeros(4), **inputs}, 4, 0)
        loss = LOSS_FUNCTIONS["gspo"](logprobs, inputs, config)
        loss.sum().backward()
        losses.append(loss.tolist())
        grads.append(logprobs.grad.tolist())
    assert losses[0] == losses[1] and grads[0] == grads[1]
    logprobs = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    flat = {"logprobs": torch.tensor(Q, dtype=torch.float64), "advantages": torch.zeros(4, dtype=torch.float64)}
    loss = LOSS_FUNCTIONS["gspo"](logprobs, flat, config)
    loss.sum().backward()
    assert loss.tolist() == [0.0] * 4 and logprobs.grad.tolist() == [0.0] * 4


def test_refusals_name_the_problem():
    with pytest.raises(LossInputError, match="needs loss_fn_config \\['beta'\\]"):
        loss_config("dro", None)
    with pytest.raises(LossInputError, match=r"loss_fn_config \['clip'\] is not a setting of ppo"):
        loss_config("ppo", {"clip": 0.2})
    with pytest.raises(LossInputError, match="loss_fn 'stable_reinforce' is not one aspen computes"):
        loss_config("stable_reinforce", None)
    with pytest.raises(LossInputError, match="datum 1: sequence_ratio_mask marks no token"):
        check_inputs("gspo", {"target_tokens": torch.zeros(2), "logprobs": torch.zeros(2),
                              "advantages": torch.ones(2), "sequence_ratio_mask": torch.zeros(2)}, 2, 1)
    with pytest.raises(LossInputError, match="datum 3: loss_fn_inputs lacks 'advantages'"):
        check_inputs("ppo", {"target_tokens": torch.zeros(2), "logprobs": torch.zeros(2)}, 2, 3)
    with pytest.raises(LossInputError, match="'weights' has shape \\(3,\\); it needs one value per"):
        check_inputs("cross_entropy", {"target_tokens": torch.zeros(2), "weights": torch.zeros(3)}, 2, 0)
