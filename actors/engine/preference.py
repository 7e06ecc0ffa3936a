"""Preference objectives of a fused step: DPO, ORPO and CPO jobs beside SFT jobs in one forward/backward.

A preference job's micro-batch is a list of `PreferencePair`s, each two sequences of the stream (prompt +
chosen, prompt + rejected) through the job's own adapter. The head gives each of their target tokens a
log-probability that is differentiable on its own (`loss.target_log_probs`); the sequences' sums (`logps`)
then enter the job's loss as plain torch expressions, as in TRL:
- DPO (TRL's DPOTrainer, loss_type sigmoid): -log sigmoid(beta * ((pc - rc) - (pr - rr))) per pair, with
  pc / pr the adapter's summed completion log-probabilities and rc / rr the reference's: the same base with
  the job's adapter off (`reference_log_probs`: a no-grad forward of the DPO jobs' rows with no adapter in the
  layout; no second model);
- ORPO (TRL's ORPOTrainer): the chosen sequences' mean token NLL (its labels: the completion, or with
  `train_on_prompt` the whole sequence as in TRL) minus beta * mean log sigmoid(log-odds ratio), the odds
  from the completions' mean token log-probabilities;
- CPO (TRL's CPOTrainer, loss_type sigmoid, no label smoothing): -log sigmoid(beta * (pc - pr)) per pair from
  the completions' summed log-probabilities (no reference), plus cpo_alpha times the chosen sequences' mean
  token NLL (its labels as ORPO's).
Each job backpropagates the sum over its pairs of its per-pair loss (ORPO's NLL counted once per pair),
times its token weight; its optimizer divides by the pairs of its optimizer step, so its step's loss is
the mean over its pairs (as TRL's over a batch), whatever shares the fused step.

Every operation here is on one job's own sequences, so isolation holds as for SFT jobs (fused == solo)."""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.data.pairs import PreferencePair
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch, JobMicroBatch, pack


@dataclass
class SequenceTargets:
    """The preference jobs' target tokens of a packed batch, by sequence: `select` picks them out of the
    batch's targets, `sequence` is each one's sequence (0-based over the preference jobs' sequences, in
    stream order) and `completion` whether it is a completion token (not an ORPO prompt label)."""

    select: torch.Tensor
    sequence: torch.Tensor
    completion: torch.Tensor
    sequences: int
    first_sequence: dict[int, int] = field(default_factory=dict)   # job index in the batch -> its first sequence


def targets_of_rows(batch: FusedBatch, sequence_of_row: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    """The batch's targets that lie in rows with a sequence number (`sequence_of_row`: one per row of the
    stream, -1 for rows of no interest): (their indices among the batch's targets, their sequence numbers,
    their rows, every row's start in the stream)."""
    device = batch.target_index.device
    starts = torch.tensor([start for start, _ in batch.layout.sequences], dtype=torch.long, device=device)
    row = torch.searchsorted(starts, batch.target_index, right=True) - 1
    row_sequence = torch.tensor(sequence_of_row, dtype=torch.long, device=device)[row]
    select = torch.nonzero(row_sequence >= 0).squeeze(1)
    return select, row_sequence[select], row[select], starts


def sequence_targets(batch: FusedBatch, micro_batches: list[JobMicroBatch], jobs: list[int]) -> SequenceTargets:
    """Where the targets of the micro-batches `jobs` (indices into `micro_batches`, whose examples are
    `PreferencePair`s) lie, by sequence."""
    device = batch.target_index.device
    sequence_of_row: list[int] = []   # per row of the stream: its preference sequence, or -1
    prompt_of_row: list[int] = []
    first: dict[int, int] = {}
    count = 0
    for index, micro_batch in enumerate(micro_batches):
        if index in jobs:
            first[index] = count
            for pair in micro_batch.examples:
                if not isinstance(pair, PreferencePair):
                    raise TypeError(f"job '{micro_batch.job}' is a preference job but its micro-batch holds "
                                    f"{type(pair).__name__}, not preference pairs")
                sequence_of_row += [count, count + 1]
                prompt_of_row += [pair.prompt_length, pair.prompt_length]
                count += 2
        else:
            rows = len(micro_batch.rows)
            sequence_of_row += [-1] * rows
            prompt_of_row += [0] * rows
    select, sequence, row, starts = targets_of_rows(batch, sequence_of_row)
    position = batch.target_index[select] + 1 - starts[row]   # the label's position in its sequence
    completion = position >= torch.tensor(prompt_of_row, dtype=torch.long, device=device)[row]
    return SequenceTargets(select, sequence, completion, count, first)


def sequence_sums(values: torch.Tensor, targets: SequenceTargets, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per sequence the sum of its targets' `values` (only where `mask`), differentiable."""
    if mask is not None:
        values = values * mask.to(values.dtype)
    return torch.zeros(targets.sequences, dtype=values.dtype, device=values.device).index_add(
        0, targets.sequence, values)


REFERENCE_SUFFIX = "@reference"   # no job name holds '@' (JOB_NAME_PATTERN)


def reference_adapter_name(job: str) -> str:
    """The name of a job's frozen reference adapter (its init_adapter, where it is the job's reference) on the base."""
    return job + REFERENCE_SUFFIX


@torch.no_grad()
def reference_layout(batch: FusedBatch, adapters: Mapping[str, str] | None = None) -> StepLayout:
    """The batch's sequences through the reference: a job's segment through its frozen reference adapter where
    `adapters` names one (job -> adapter), else no adapter's segment (no LoRA layer adds anything: the base)."""
    adapters = adapters or {}
    segments = tuple((adapters[name], start, end) for name, start, end in batch.layout.segments if name in adapters)
    return StepLayout(segments, batch.layout.sequences, batch.layout.num_tokens, jobs=batch.layout.job_ranges)


def reference_log_probs(base: BaseModel, micro_batches: list[JobMicroBatch], chunk: int,
                        adapters: Mapping[str, str] | None = None) -> list[torch.Tensor]:
    """Per micro-batch (of preference pairs) its pairs' (chosen, rejected) summed completion log-probabilities
    under the reference: one no-grad forward of their sequences, packed, with no adapter in the layout (so
    no LoRA layer adds anything) - the reference policy of DPO without a second copy of the model - or, for a
    job in `adapters`, its frozen reference adapter (`reference_layout`)."""
    batch = pack(micro_batches, "packed", base.pad_token_id).to(base.device)
    with step_layout(reference_layout(batch, adapters)):
        hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    return reference_sums(base, batch, micro_batches, hidden, chunk)


def reference_sums(base: BaseModel, batch: FusedBatch, micro_batches: list[JobMicroBatch], hidden: torch.Tensor,
                   chunk: int) -> list[torch.Tensor]:
    """`reference_log_probs` from the final hidden states of the reference forward (a pipeline's last stage
    has them from the stage before)."""
    head = base.lm_head
    weights = torch.ones(batch.target_ids.numel(), device=hidden.device)
    _, losses = target_cross_entropy(hidden[batch.target_index], head.weight, head.bias, batch.target_ids, weights,
                                     chunk, base.logit_transform)
    targets = sequence_targets(batch, micro_batches, list(range(len(micro_batches))))
    sums = sequence_sums(-losses[targets.select], targets, targets.completion)
    out = []
    for index, micro_batch in enumerate(micro_batches):
        first = targets.first_sequence[index]
        out.append(sums[first:first + 2 * len(micro_batch.examples)].view(-1, 2))
    return out


class ReferenceCache:
    """A DPO job's reference log-probabilities by pair (a 128-bit digest of its tokens and labels): the base
    is frozen, so a pair's reference is a constant, computed the first time the pair is trained on and
    reused when the data comes round again (later epochs, evaluations of the same pairs). At most `limit`
    pairs are kept (about 100 bytes each); beyond that, new pairs are computed each time."""

    def __init__(self, limit: int = 1 << 18):
        self.limit = limit
        self.values: dict[bytes, tuple[float, float]] = {}

    @staticmethod
    def key(pair: PreferencePair) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for row in pair.rows:
            digest.update(array("q", row.input_ids).tobytes())
            digest.update(array("q", row.labels).tobytes())
            digest.update(b"|")
        digest.update(str(pair.prompt_length).encode())
        return digest.digest()

    @staticmethod
    def lookup(base: BaseModel, micro_batches: list[JobMicroBatch], caches: list[ReferenceCache], chunk: int,
               adapters: Mapping[str, str] | None = None) -> list[torch.Tensor]:
        """`reference_log_probs` of the micro-batches (each with its job's cache), computing only the pairs
        its cache does not hold (all jobs' in one forward) and keeping them. `adapters`: the jobs' frozen
        reference adapters, where they have one (constant too: the cache holds)."""
        keys, todo = ReferenceCache.missing(micro_batches, caches)
        computed = reference_log_probs(base, [mb for _, _, mb in todo], chunk, adapters) if todo else []
        fresh = ReferenceCache.store(todo, computed, caches)
        return ReferenceCache.assemble(keys, caches, fresh, base.device)

    @staticmethod
    def missing(micro_batches: list[JobMicroBatch], caches: list[ReferenceCache]
                ) -> tuple[list[list[bytes]], list[tuple[int, list[bytes], JobMicroBatch]]]:
        """Each micro-batch's pair keys, and what to compute: (micro-batch index, its uncached keys, a
        micro-batch of those pairs) for each micro-batch with pairs its cache lacks."""
        keys = [[ReferenceCache.key(pair) for pair in mb.examples] for mb in micro_batches]
        todo: list[tuple[int, list[bytes], JobMicroBatch]] = []
        for index, (mb, job_keys, cache) in enumerate(zip(micro_batches, keys, caches, strict=True)):
            wanted: dict[bytes, PreferencePair] = {}
            for pair, key in zip(mb.examples, job_keys, strict=True):
                if key not in cache.values:
                    wanted.setdefault(key, pair)
            if wanted:
                todo.append((index, list(wanted), JobMicroBatch(mb.job, list(wanted.values()))))
        return keys, todo

    @staticmethod
    def store(todo: list[tuple[int, list[bytes], JobMicroBatch]], computed: list[torch.Tensor] | None,
              caches: list[ReferenceCache]) -> dict[int, dict[bytes, tuple[float, float]]]:
        """Keep the computed pairs (up to each cache's limit); `computed` None keeps the keys only, with no
        value (a pipeline's head, which mirrors which pairs its last stage holds). Returns them by index."""
        fresh: dict[int, dict[bytes, tuple[float, float]]] = {}
        for position, (index, wanted_keys, _) in enumerate(todo):
            values = computed[position].tolist() if computed is not None else [(math.nan, math.nan)] * len(wanted_keys)
            fresh[index] = {key: (chosen, rejected) for key, (chosen, rejected) in zip(wanted_keys, values,
                                                                                       strict=True)}
            cache = caches[index]
            for key, value in fresh[index].items():
                if len(cache.values) >= cache.limit:
                    break
                cache.values[key] = value
        return fresh

    @staticmethod
    def assemble(keys: list[list[bytes]], caches: list[ReferenceCache], fresh: dict[int, dict[bytes, tuple]],
                 device: torch.device) -> list[torch.Tensor]:
        out = []
        for index, cache in enumerate(caches):
            new = fresh.get(index, {})
            rows = [cache.values[key] if key in cache.values else new[key] for key in keys[index]]
            out.append(torch.tensor(rows, dtype=torch.float32, device=device))
        return out


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (TRL's ORPO)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class PreferenceOutcome:
    """One preference job's part of a fused step: `objective` (the sum over its pairs of the per-pair loss,
    differentiable), `loss` (the mean over its pairs), `pairs`, and its metrics (means over its pairs)."""

    objective: torch.Tensor
    loss: float
    pairs: int
    metrics: dict[str, float]


def dpo_objective(chosen: torch.Tensor, rejected: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[
        torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair sigmoid DPO losses and their reward metrics, from the adapter's summed completion
    log-probabilities and the reference's ((pairs, 2): chosen, rejected)."""
    chosen_ratio = chosen - reference[:, 0]
    rejected_ratio = rejected - reference[:, 1]
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    return losses, {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                    "rewards/margins": chosen_rewards - rejected_rewards,
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                    "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}


def orpo_objective(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, nll: torch.Tensor, beta: float
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair ORPO losses (the micro-batch's chosen NLL `nll` counted once per pair, minus beta times the log
    sigmoid of the log-odds ratio) and their metrics, from the completions' mean token log-probabilities."""
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    ratio = F.logsigmoid(log_odds)
    losses = nll - beta * ratio
    chosen_rewards, rejected_rewards = beta * chosen_mean.detach(), beta * rejected_mean.detach()
    return losses, {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                    "rewards/margins": chosen_rewards - rejected_rewards,
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                    "logps/chosen": chosen_mean.detach(), "logps/rejected": rejected_mean.detach(),
                    "nll_loss": nll.detach().expand_as(ratio), "log_odds_ratio": ratio.detach(),
                    "log_odds_chosen": log_odds.detach()}


def cpo_objective(chosen: torch.Tensor, rejected: torch.Tensor, nll: torch.Tensor, beta: float, alpha: float
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair CPO losses (the sigmoid loss on beta times the summed completion log-probability margin, plus
    `alpha` times the micro-batch's chosen NLL `nll`, counted once per pair) and TRL's metrics."""
    if alpha == 0:
        nll = torch.zeros_like(nll)   # TRL's: no NLL term, and 0 as its metric
    losses = -F.logsigmoid(beta * (chosen - rejected)) + alpha * nll
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    return losses, {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                    "rewards/margins": chosen_rewards - rejected_rewards,
                    "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                    "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach(),
                    "nll_loss": nll.detach().expand_as(chosen)}


def chosen_nll(log_probs: torch.Tensor, targets: SequenceTargets, first: int, pairs: int) -> torch.Tensor:
    """The mean token NLL over the chosen sequences' targets (ORPO's and CPO's language-modelling term)."""
    every = sequence_sums(log_probs, targets)[first:first + 2 * pairs:2]
    count = sequence_sums(torch.ones_like(log_probs), targets)[first:first + 2 * pairs:2].sum()
    return -every.sum() / count.clamp_min(1.0)


def job_outcome(method: str, beta: float, log_probs: torch.Tensor, targets: SequenceTargets, first: int, pairs: int,
                reference: torch.Tensor | None, cpo_alpha: float = 1.0) -> PreferenceOutcome:
    """One preference job's objective from the step's preference log-probabilities (`log_probs`, one per
    target of `targets`): its sequences are `first` .. `first + 2 * pairs`, chosen then rejected per pair."""
    completion = sequence_sums(log_probs, targets, targets.completion)[first:first + 2 * pairs]
    chosen, rejected = completion[0::2], completion[1::2]
    if method == "dpo":
        if reference is None:
            raise ValueError("a DPO job's step needs its reference log-probabilities")
        losses, metrics = dpo_objective(chosen, rejected, reference, beta)
    elif method == "orpo":
        counts = sequence_sums(torch.ones_like(log_probs), targets, targets.completion)[first:first + 2 * pairs]
        nll = chosen_nll(log_probs, targets, first, pairs)
        losses, metrics = orpo_objective(chosen / counts[0::2].clamp_min(1.0), rejected / counts[1::2].clamp_min(1.0),
                                         nll, beta)
    elif method == "cpo":
        losses, metrics = cpo_objective(chosen, rejected, chosen_nll(log_probs, targets, first, pairs), beta, cpo_alpha)
    else:
        raise ValueError(f"method '{method}' has no preference objective (dpo, orpo or cpo)")
    means = {name: float(value.float().mean()) for name, value in metrics.items()}
    return PreferenceOutcome(losses.sum(), float(losses.detach().mean()), pairs, means)


@torch.no_grad()
def evaluate_preference(base: BaseModel, adapter: str, method: str, beta: float, examples: list[PreferencePair],
                        batch_size: int, chunk: int, cache: ReferenceCache | None = None, *,
                        cpo_alpha: float = 1.0, reference_adapter: str | None = None) -> float:
    """A preference job's eval loss: its objective's mean over the pairs `examples` (ORPO's NLL per batch
    of `batch_size` pairs), the adapter in evaluation mode (the caller's); DPO's references through `cache`
    (`reference_adapter`: the job's frozen reference adapter, where it has one)."""
    adapters = {adapter: reference_adapter} if reference_adapter is not None else None
    loss_sum, pairs = 0.0, 0
    for start in range(0, len(examples), batch_size):
        micro_batch = JobMicroBatch(adapter, examples[start:start + batch_size])
        reference = None
        if method == "dpo":
            reference = ReferenceCache.lookup(base, [micro_batch], [cache if cache is not None else ReferenceCache(0)],
                                              chunk, adapters)[0]
        batch = pack([micro_batch], "packed", base.pad_token_id).to(base.device)
        with step_layout(batch.layout):
            hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                  attention_mask=None, use_cache=False).last_hidden_state[0]
        outcome = evaluation_outcome(base, method, beta, batch, micro_batch, hidden, chunk, reference, cpo_alpha)
        loss_sum += outcome.loss * outcome.pairs
        pairs += outcome.pairs
    return loss_sum / max(pairs, 1)


def evaluation_outcome(base: BaseModel, method: str, beta: float, batch: FusedBatch, micro_batch: JobMicroBatch,
                       hidden: torch.Tensor, chunk: int, reference: torch.Tensor | None,
                       cpo_alpha: float = 1.0) -> PreferenceOutcome:
    """One eval batch's preference outcome from its final hidden states."""
    head = base.lm_head
    weights = torch.ones(batch.target_ids.numel(), device=hidden.device)
    _, losses = target_cross_entropy(hidden[batch.target_index], head.weight, head.bias, batch.target_ids,
                                     weights, chunk, base.logit_transform)
    targets = sequence_targets(batch, [micro_batch], [0])
    return job_outcome(method, beta, -losses[targets.select], targets, 0, len(micro_batch.examples), reference,
                       cpo_alpha)
