"""The loss of one fused step from the final hidden states: what a single-device trainer and a pipeline's
last stage both compute.

SFT jobs' target tokens go through the token-weighted chunked cross-entropy (LM head only at target
positions); preference jobs' (method dpo / orpo / cpo) through per-token log-probabilities into their
objectives (actors/engine/preference.py), GRPO jobs' completions likewise into theirs
(actors/engine/grpo.py). Returns the step's differentiable total and, per job, its loss (the mean over its
target tokens, or its preference / GRPO loss), what that mean is over (targets, pairs, completion tokens or
completions) and its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.engine.grpo import completion_targets, grpo_outcome, tempered
from actors.engine.loss import target_cross_entropy, target_log_probs
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch, JobMicroBatch
from actors.engine.preference import job_outcome, sequence_targets
from actors.spec.job_spec import JobSpec
from actors.spec.method_config import PREFERENCE_METHODS
from actors.storage.transfer import values_to_device


@dataclass(frozen=True)
class ObjectiveJob:
    """What the objective needs of a job: its spec (method, preference beta) and its token weight (1, or its
    float16 loss scale)."""

    spec: JobSpec
    token_weight: float = 1.0


@dataclass
class StepObjective:
    total: torch.Tensor                       # differentiable: backward from it
    job_losses: torch.Tensor                  # (jobs,) float32 on the step's device: each job's loss
    counts: list[int]                         # what each job's loss is the mean over: target tokens, or pairs
    metrics: list[dict[str, float] | None]    # a preference job's rewards / margins
    completion_logps: dict[int, torch.Tensor] = field(default_factory=dict)   # GRPO jobs': their tokens', detached

    @property
    def losses(self) -> list[float]:
        """The jobs' losses read back to the host (on CUDA this waits for the step: read them after it is
        queued whole; the trainer reads them with the optimizers' norms in one go)."""
        return self.job_losses.tolist()


def token_weights(batch: FusedBatch, jobs: list[ObjectiveJob]) -> torch.Tensor:
    """Each target token weighs its job's token weight (1, or its float16 loss scale): the adapters'
    gradients sum their own tokens' gradients, and each job's optimizer turns the sum into the mean
    over its step's target tokens (token-weighted accumulation), so no job's scale depends on its
    neighbours or on how its tokens fell into micro-batches."""
    per_job = values_to_device([job.token_weight for job in jobs], torch.float32, batch.target_job.device)
    return per_job[batch.target_job]


def step_objective(base: BaseModel, batch: FusedBatch, hidden: torch.Tensor, jobs: list[ObjectiveJob],
                   micro_batches: list[JobMicroBatch], references: dict[int, torch.Tensor],
                   loss_chunk: int, olds: dict[int, torch.Tensor] | None = None) -> StepObjective:
    """`hidden`: the step's final hidden states (T, d); `references`: the DPO jobs' reference
    log-probabilities by job index ((pairs, 2) sums), and the GRPO jobs' with beta > 0 (per completion token);
    `olds`: a replaying GRPO job's completion tokens' log-probabilities at their generation (grpo_replay.py)."""
    weights = token_weights(batch, jobs)
    head = base.lm_head
    preference = [index for index, job in enumerate(jobs) if job.spec.method in PREFERENCE_METHODS]
    grpo = [index for index, job in enumerate(jobs) if job.spec.method == "grpo"]
    counts = list(batch.job_targets)
    metrics: list[dict[str, float] | None] = [None] * len(jobs)
    if not preference and not grpo:
        total, losses = target_cross_entropy(hidden[batch.target_index], head.weight, head.bias, batch.target_ids,
                                             weights, loss_chunk, base.logit_transform)
        return StepObjective(total, _per_job_losses(batch, losses), counts, metrics)
    keep = torch.ones(batch.target_ids.numel(), dtype=torch.bool, device=hidden.device)
    targets = sequence_targets(batch, micro_batches, preference) if preference else None
    completions = completion_targets(batch, micro_batches, grpo) if grpo else None
    for special in (targets, completions):
        if special is not None:
            keep[special.select] = False
    plain = torch.nonzero(keep).squeeze(1)
    total, plain_losses = target_cross_entropy(hidden[batch.target_index[plain]], head.weight, head.bias,
                                               batch.target_ids[plain], weights[plain], loss_chunk,
                                               base.logit_transform)
    losses = torch.empty(batch.target_ids.numel(), dtype=torch.float32, device=hidden.device)
    losses[plain] = plain_losses
    outcomes = {}
    completion_logps: dict[int, torch.Tensor] = {}
    if targets is not None:
        log_probs = target_log_probs(hidden[batch.target_index[targets.select]], head.weight, head.bias,
                                     batch.target_ids[targets.select], loss_chunk, base.logit_transform)
        for index in preference:
            spec = jobs[index].spec
            outcomes[index] = job_outcome(spec.method, spec.preference.beta, log_probs, targets,
                                          targets.first_sequence[index], len(micro_batches[index].examples),
                                          references.get(index), spec.preference.cpo_alpha)
        losses[targets.select] = -log_probs.detach()
    if completions is not None:
        for index in grpo:
            config = jobs[index].spec.grpo
            first = completions.first_sequence[index]
            mine = (completions.sequence >= first) & (completions.sequence < first + len(micro_batches[index].rows))
            select = completions.select[mine]
            logp = target_log_probs(hidden[batch.target_index[select]], head.weight, head.bias,
                                    batch.target_ids[select], loss_chunk, tempered(base.logit_transform,
                                                                                   config.temperature))
            outcomes[index] = grpo_outcome(config, logp, completions.sequence[mine] - first, references.get(index),
                                           micro_batches[index].examples, (olds or {}).get(index))
            losses[select] = -logp.detach()
            completion_logps[index] = logp.detach()
    for index, outcome in outcomes.items():
        total = total + outcome.objective * jobs[index].token_weight
    per_job = _per_job_losses(batch, losses)
    for index, outcome in outcomes.items():
        per_job[index], counts[index], metrics[index] = outcome.loss, outcome.pairs, outcome.metrics
    return StepObjective(total, per_job, counts, metrics, completion_logps)


def _per_job_losses(batch: FusedBatch, losses: torch.Tensor) -> torch.Tensor:
    """Each job's mean loss over its target tokens, on the device (nothing read back here)."""
    sums = torch.zeros(len(batch.jobs), dtype=torch.float32, device=losses.device)
    sums.index_add_(0, batch.target_job, losses)
    counts = batch.job_target_counts
    if counts is None or counts.device != losses.device:
        counts = values_to_device(batch.job_targets, torch.long, losses.device)
    return sums / counts.clamp_min(1)


def fixed_objective(base: BaseModel, hidden: torch.Tensor, target_ids: torch.Tensor, target_job: torch.Tensor,
                    job_targets: torch.Tensor, loss_chunk: int) -> StepObjective:
    """The SFT loss of a step in a fixed shape (actors/engine/fixed_shapes.py), from device tensors only, so that it
    can be captured as a CUDA graph: every position a target slot, those of no job (`target_job` equal to the number
    of jobs) weighing 0; each job's mean over its `job_targets`. Token weights are 1 (no float16 loss scale). The
    counts and metrics are the caller's (from the host's batch)."""
    jobs = job_targets.numel()
    weights = (target_job < jobs).to(torch.float32)
    total, losses = target_cross_entropy(hidden, base.lm_head.weight, base.lm_head.bias, target_ids, weights,
                                         loss_chunk, base.logit_transform)
    sums = torch.zeros(jobs + 1, dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, target_job, losses)
    return StepObjective(total, sums[:jobs] / job_targets.clamp_min(1), [], [None] * jobs)
