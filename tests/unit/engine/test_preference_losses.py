"""Preference losses (method dpo / orpo / cpo) against TRL: the loss, the adapter's gradients and the reward
metrics equal TRL's (DPOTrainer and the experimental ORPOTrainer and CPOTrainer, on a PEFT LoRA model with the
same weights, the reference being PEFT's model with its adapter disabled); DPO's reference log-probabilities
are the base model's own plain forward; the chunked head's target log-probabilities backpropagate as plain
autograd through the whole logits does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.data import PreferenceFormat
from actors.data.pairs import PreferencePair, tokenize_pair
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.models import tiny_model
from tests.helpers.pairs import ROWS, random_pairs, trl_pairs
from tests.helpers.peft_reference import TARGETS, compare_gradients, copy_peft_lora, peft_config, randomize_b
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance


def _aspen_job(method: str, pairs: list[PreferencePair], peft_model, **spec):
    """aspen's trainer on the same base weights, its adapter a copy of PEFT's; grad_accum 2, so that after
    one fused step the adapter's summed gradients are still there (no optimizer step yet)."""
    base = from_module(tiny_model("llama"), None)
    job_spec = JobSpec(name=method, data="unused.jsonl", format={"type": "preference"}, method=method,
                       batch_size=len(pairs), grad_accum=2, max_steps=5,
                       lora={"r": 4, "alpha": 8, "target_modules": TARGETS}, **spec)
    job = TrainingJob.create(job_spec, base, pairs, [], seed=0)
    copy_peft_lora(job, peft_model)
    trainer = FusedTrainer(base)
    trainer.add_job(job)
    return trainer, job


def _tolerances(config, pairs: list[PreferencePair], largest: float, logps: float) -> tuple[float, float]:
    """(gradient, log-prob) tolerances of aspen against TRL (tests/helpers/tolerances.py: the same sums in other
    orders). A gradient entry: the chain through the forward and backward of the pairs' sequences, relative to
    the largest entry. A sequence's log-prob (`logps`: the batch's largest in magnitude): the forward and the
    sum over its tokens; its tokens' log-probs are all <= 0 (no cancellation), and each token's terms (its
    logit and the log-sum-exp) are taken as twice its log-prob (probabilities below 1/2, as in these random
    models)."""
    longest = max(len(row) for pair in pairs for row in pair.rows)
    tokens = sum(len(row) for pair in pairs for row in pair.rows)
    gradient = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=tokens), largest)
    logp = rounding_tolerance(llama_chain_terms(config, sequence=longest, tokens=longest, backward=False), 2 * logps)
    return gradient, logp


def _step_against_trl(name: str, method: str, pairs: list[PreferencePair], peft_model, loss, **spec):
    """One fused step of aspen's `method` job on PEFT's adapter, against TRL's `loss` (its backward taken): the
    gradients checked within their bound; (aspen's step result, its metrics, |loss difference|, the log-prob
    tolerance), the log-probs being means over each sequence's tokens (their magnitude the larger mean)."""
    trainer, job = _aspen_job(method, pairs, peft_model, **spec)
    result = trainer.train_step().results[0]
    loss_difference = abs(result.loss - loss.item())
    gradient_difference, largest = compare_gradients(job, len(pairs), peft_model)
    print(f"{name} vs TRL: loss {loss.item():.6f}, |loss difference| {loss_difference:.2e}, "
          f"max |gradient difference| {gradient_difference:.2e} (largest {largest:.2e})")
    ours = job.accumulator.metrics
    logps = len(pairs) * max(abs(ours["logps/chosen"]), abs(ours["logps/rejected"]))
    gradient_tolerance, logp_tolerance = _tolerances(trainer.base.model.config, pairs, largest, logps)
    print(f"tolerances: gradient {gradient_tolerance:.2e}, log-prob {logp_tolerance:.2e}")
    assert gradient_difference <= gradient_tolerance
    return result, ours, loss_difference, logp_tolerance


def test_dpo_loss_and_gradients_equal_trl(tiny_tokenizer, tmp_path):
    trl, batch, pairs = trl_pairs(ROWS, tiny_tokenizer, tmp_path)
    assert set(trl.model.peft_config) == {"default"}
    peft_model = randomize_b(trl.model, 0)
    loss = trl.compute_loss(trl.model, batch)
    loss.backward()
    # aspen's own tokenization of the rows gives TRL's sequences
    fmt = PreferenceFormat()
    own = {tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512) for row in ROWS}
    assert own == set(pairs)

    trainer, job = _aspen_job("dpo", pairs, peft_model)
    report = trainer.train_step()
    result = report.results[0]
    assert result.optimizer_step is None
    loss_difference = abs(result.loss - loss.item())
    gradient_difference, largest = compare_gradients(job, len(pairs), peft_model)
    print(f"DPO vs TRL: loss {loss.item():.6f}, |loss difference| {loss_difference:.2e}, "
          f"max |gradient difference| {gradient_difference:.2e} (largest {largest:.2e})")
    assert abs(loss.item() - 0.6931) > 1e-3, "the adapter changed nothing: DPO's loss is log 2"
    metrics = job.accumulator.metrics
    # the batch's largest sequence log-prob: at most the pairs' count times the larger mean (all are <= 0)
    logps = len(pairs) * max(abs(metrics["logps/chosen"]), abs(metrics["logps/rejected"]))
    gradient_tolerance, logp_tolerance = _tolerances(trainer.base.model.config, pairs, largest, logps)
    print(f"tolerances: gradient {gradient_tolerance:.2e}, log-prob {logp_tolerance:.2e}")
    assert gradient_difference <= gradient_tolerance
    # a pair's loss -log σ(β·margin) moves at most β times its margin, a sum of four log-probs (policy and
    # reference, chosen and rejected)
    beta = job.spec.preference.beta
    assert loss_difference <= beta * 4 * logp_tolerance
    # the reward metrics are TRL's: β times two log-probs (chosen, rejected), four (margins); the accuracies
    # (the share of margins > 0) exactly: a margin would have to lie within its tolerance of 0 to flip one
    logged = trl._metrics["train"]
    reward = beta * 2 * logp_tolerance
    for name, tolerance in (("rewards/chosen", reward), ("rewards/rejected", reward),
                            ("rewards/margins", 2 * reward), ("logps/chosen", logp_tolerance)):
        assert abs(metrics[name] - logged[name][-1]) <= tolerance, (name, metrics[name], logged[name][-1])
    assert metrics["rewards/accuracies"] == logged["rewards/accuracies"][-1]


def _orpo_trainer(beta: float):
    """TRL's ORPOTrainer's loss code (get_batch_loss_metrics: concatenated forward, NLL, odds ratio) on a
    batch, without its dataset machinery: the attributes those methods read."""
    from trl.experimental.orpo import ORPOTrainer

    trainer = object.__new__(ORPOTrainer)
    trainer.beta = beta
    trainer.is_encoder_decoder = False
    trainer.padding_value = 0
    trainer.aux_loss_enabled = False
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value)
    return trainer


def _orpo_batch(pairs: list[PreferencePair]) -> dict[str, torch.Tensor]:
    """TRL's ORPO batch of `pairs`: chosen_/rejected_ input_ids, attention_mask and labels (the prompt
    masked), right padded."""
    batch = {}
    for side in ("chosen", "rejected"):
        rows = [getattr(pair, side) for pair in pairs]
        longest = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        labels = torch.full((len(rows), longest), -100, dtype=torch.long)
        for i, (row, pair) in enumerate(zip(rows, pairs, strict=True)):
            ids[i, :len(row)] = torch.tensor(row.input_ids)
            mask[i, :len(row)] = 1
            labels[i, pair.prompt_length:len(row)] = torch.tensor(row.input_ids[pair.prompt_length:])
        batch |= {f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels}
    return batch


def test_orpo_loss_and_gradients_equal_trl(tiny_tokenizer):
    beta = 0.25
    fmt = PreferenceFormat()
    # train_on_prompt: the chosen sequence's NLL covers the prompt too, as TRL's ORPOTrainer computes it
    pairs = [tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512, train_on_prompt=True) for row in ROWS]
    from peft import get_peft_model

    peft_model = randomize_b(get_peft_model(tiny_model("llama"), peft_config()), 1)
    loss, metrics = _orpo_trainer(beta).get_batch_loss_metrics(peft_model, _orpo_batch(pairs))
    loss.backward()

    _, ours, loss_difference, logp_tolerance = _step_against_trl("ORPO", "orpo", pairs, peft_model, loss,
                                                                 preference={"beta": beta}, train_on_prompt=True)
    # the log-odds of a pair: two mean log-probs, each with log1p(-exp(.)) of it (whose derivative, below 1 for
    # log-probs below -log 2, adds at most as much again); their log-sigmoid moves at most as much; the NLL is a
    # mean log-prob; the loss, NLL - β·log σ(log-odds); the margins, β times two mean log-probs. (Coarse for
    # the log-odds and margins, small differences of log-probs: the gradients, which follow from them, are
    # the close check.)
    odds = 4 * logp_tolerance
    for name, tolerance in (("nll_loss", logp_tolerance), ("log_odds_chosen", odds), ("log_odds_ratio", odds),
                            ("rewards/margins", beta * 2 * logp_tolerance)):
        assert abs(ours[name] - metrics[name]) <= tolerance, (name, ours[name], metrics[name])
    assert loss_difference <= logp_tolerance + beta * odds
    assert ours["rewards/accuracies"] == metrics["rewards/accuracies"]


def _cpo_trainer(beta: float, cpo_alpha: float):
    """TRL's CPOTrainer's loss code (get_batch_loss_metrics: concatenated forward, sigmoid loss, NLL) on a batch,
    without its dataset machinery: the attributes those methods read (loss_type sigmoid, no AlphaPO, no label
    smoothing: its defaults)."""
    from trl.experimental.cpo import CPOTrainer

    trainer = object.__new__(CPOTrainer)
    trainer.beta, trainer.cpo_alpha = beta, cpo_alpha
    trainer.loss_type, trainer.alpha, trainer.label_smoothing, trainer.simpo_gamma = "sigmoid", 0.0, 0.0, 0.5
    trainer.is_encoder_decoder = False
    trainer.pad_token_id = 0
    trainer.aux_loss_enabled = False
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda value: value)
    return trainer


@pytest.mark.parametrize("cpo_alpha", [1.0, 0.0])
def test_cpo_loss_and_gradients_equal_trl(tiny_tokenizer, cpo_alpha):
    beta = 0.2
    fmt = PreferenceFormat()
    # CPO's NLL covers the chosen completion (TRL's labels mask the prompt): no train_on_prompt
    pairs = [tokenize_pair(row, fmt, tiny_tokenizer, max_seq_len=512) for row in ROWS]
    from peft import get_peft_model

    peft_model = randomize_b(get_peft_model(tiny_model("llama"), peft_config()), 2)
    loss, metrics = _cpo_trainer(beta, cpo_alpha).get_batch_loss_metrics(peft_model, _orpo_batch(pairs))
    loss.backward()

    preference = {"beta": beta} | ({"cpo_alpha": cpo_alpha} if cpo_alpha != 1.0 else {})
    result, ours, loss_difference, logp_tolerance = _step_against_trl(
        f"CPO (cpo_alpha {cpo_alpha})", "cpo", pairs, peft_model, loss, preference=preference)
    # a pair's -log σ(β·margin) moves at most β times its margin (two log-probs); the NLL is a mean log-prob
    for name, tolerance in (("logps/chosen", logp_tolerance), ("rewards/margins", beta * 2 * logp_tolerance),
                            ("nll_loss", logp_tolerance)):
        assert abs(ours[name] - metrics[name]) <= tolerance, (name, ours[name], metrics[name])
    assert loss_difference <= beta * 2 * logp_tolerance + cpo_alpha * logp_tolerance
    assert ours["rewards/accuracies"] == metrics["rewards/accuracies"]
    if cpo_alpha == 0.0:
        assert metrics["nll_loss"] == 0.0 and loss.item() == pytest.approx(result.loss, abs=beta * 2 * logp_tolerance)


def test_dpo_reference_is_the_base_without_any_adapter():
    """The reference log-probabilities are the base model's own (its plain forward, no adapter module),
    whatever the job's adapter holds."""
    from actors.engine.packing import JobMicroBatch
    from actors.engine.preference import reference_log_probs

    model = tiny_model("llama", 300)
    pairs = random_pairs(5, 3)
    with torch.no_grad():
        expected = []
        for pair in pairs:
            for row in pair.rows:
                logits = model(input_ids=torch.tensor([row.input_ids])).logits[0, :-1].log_softmax(-1)
                labels = torch.tensor(row.labels[1:])
                keep = labels != -100
                expected.append(float(logits[keep].gather(1, labels[keep][:, None]).sum()))
    base = from_module(model, None)
    spec = JobSpec(name="dpo", data="unused.jsonl", format={"type": "preference"}, method="dpo", batch_size=3,
                   max_steps=1, lora={"target_modules": "all-linear"})
    job = TrainingJob.create(spec, base, pairs, [], seed=0)
    with torch.no_grad():
        for parameter in job.adapter.parameters():
            parameter.fill_(0.5)   # an adapter that would change every logit
    got = reference_log_probs(base, [JobMicroBatch("dpo", pairs)], 1024)[0].flatten().tolist()
    # the same sums in other orders (a packed forward, a chunked head): each sequence's log-prob within the
    # rounding tolerance of its forward and its tokens' sum (tests/helpers/tolerances.py), its tokens' terms taken as
    # twice its log-prob (all <= 0; probabilities below 1/2 in this random model)
    longest = max(len(row) for pair in pairs for row in pair.rows)
    terms = llama_chain_terms(model.config, sequence=longest, tokens=longest, backward=False)
    for a, b in zip(got, expected, strict=True):
        assert abs(a - b) <= rounding_tolerance(terms, 2 * abs(b)), (a, b)


@pytest.mark.parametrize("transform", [{}, {"multiply": 0.5, "softcap": 3.0}])
def test_target_log_probs_backpropagate_any_function_of_them(transform):
    """The chunked head's per-token log-probabilities and their gradient through a nonlinear function of
    per-sequence sums equal plain autograd through the whole logits (with a model's logit transform)."""
    from actors.engine.loss import target_log_probs
    from actors.engine.model_support import LogitTransform

    transform = LogitTransform(**transform)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=generator, dtype=torch.float64)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 40, (50,), generator=generator)
    sequence = torch.arange(50) // 10

    def objective(log_probs):
        sums = torch.zeros(5, dtype=log_probs.dtype).index_add(0, sequence, log_probs)
        return torch.nn.functional.logsigmoid(0.3 * (sums[0::2][:2] - sums[1::2])).sum()

    ours = hidden.clone().requires_grad_(True)
    log_probs = target_log_probs(ours, weight, None, targets, chunk=16, transform=transform)
    objective(log_probs).backward()
    plain = hidden.clone().requires_grad_(True)
    logits = plain @ weight.T * transform.multiply
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    expected = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    objective(expected).backward()
    assert torch.allclose(log_probs.double(), expected, atol=1e-5)
    assert torch.allclose(ours.grad, plain.grad, atol=1e-5) and float(plain.grad.abs().max()) > 1e-3
