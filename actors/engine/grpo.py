"""GRPO jobs in a fused step: sampled completions, their rewards, and TRL's GRPO loss beside other jobs.

A `method: grpo` job's data is prompts with a target text (any SFT format: the prompt is every token before
the first target, the reference the target's text). Before each fused step its micro-batch of prompts becomes
`Rollout`s (`rollouts`): `num_generations` completions per prompt sampled with the job's own adapter on the
trainer (actors/engine/generate.py, a seeded generator: the same seed and step give the same completions,
alone or fused), each scored by the job's rewards (actors/engine/grpo_rewards.py: exact match, contains, regex
against the row's reference, or the user's `module:function(prompts, completions, rows)`; several, weighted), and
the rewards turned into TRL's group-relative advantages (reward minus its group's mean, over the group's standard
deviation plus 1e-4). The completions (prompt + completion, the completion's tokens the targets, up to and
including an EOS) are packed into the fused step like any job's rows, through the job's adapter.

The loss (`grpo_outcome`) is TRL's GRPOTrainer's for one iteration per generation (its default): per
completion token -min(r * A, clip(r, 1 - epsilon, 1 + epsilon) * A) with r = exp(logp - logp.detach()) (1
in value, its gradient the policy gradient), plus beta times the k3 estimate of the KL to the reference
(exp(ref - logp) - (ref - logp) - 1, times r as TRL's default `use_bias_correction_kl`; the reference being
the base with the adapter off, as DPO's is), the
log-probabilities taken at the sampling temperature; `dapo` (TRL's default) averages it over every
completion token of the optimizer step, `grpo` over each completion's tokens, then over the completions. With
`mask_truncated_completions`, a completion that reached max_new_tokens without an EOS (or pad) at its end, as TRL
tells one, has no targets: it counts in its group's advantages, not in the loss.

A reward that fails is a `RewardError` (grpo_rewards.py): that job fails, the others go on (the trainer loop).
Every operation here is on one job's own sequences."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from actors.data import Example
from actors.data.tokenize import IGNORE_INDEX
from actors.engine.generate import Decoder, Sampling, greedy_generate_many, needs_eager_attention
from actors.engine.generation_eval import ScoredRow, scored_rows, stop_token_ids
from actors.engine.grpo_rewards import RewardError, group_scores, reward_metrics, reward_scores
from actors.engine.layout import step_layout
from actors.engine.loss import target_log_probs
from actors.engine.model_support import LogitTransform
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch, JobMicroBatch, pack
from actors.engine.preference import PreferenceOutcome, reference_layout, targets_of_rows
from actors.engine.user_calls import FunctionWorker
from actors.spec.method_config import GrpoConfig


@dataclass(frozen=True)
class Rollout:
    """One prompt's sampled completions as training sequences (prompt + completion, the completion's tokens
    the targets), their rewards (NaN: no reward function scored it), each reward function's scores (NaN: it did
    not apply) and advantages. `len()` is their tokens (what they occupy in a packed step)."""

    completions: tuple[Example, ...]
    prompt_length: int
    rewards: tuple[float, ...]
    scores: tuple[tuple[float, ...], ...]   # each completion's, one a reward function
    advantages: tuple[float, ...]
    truncated: tuple[bool, ...] = ()   # each completion: it reached max_new_tokens without ending (no EOS)

    def __len__(self) -> int:
        return sum(len(c) for c in self.completions)

    @property
    def rows(self) -> tuple[Example, ...]:
        return self.completions

    @property
    def num_targets(self) -> int:
        return sum(c.num_targets for c in self.completions)


def _completion_text(base: BaseModel, tokens: list[int], stops: set[int]) -> str:
    for index, token in enumerate(tokens):
        if token in stops:
            tokens = tokens[:index]
            break
    return base.tokenizer.decode(tokens, skip_special_tokens=True)


def rollouts(base: BaseModel, adapter: str, config: GrpoConfig, examples: Sequence[Example], seed: int,
             worker: FunctionWorker | None = None, decoder: Decoder | None = None) -> list[Rollout]:
    """Each example's prompt, `num_generations` sampled completions through `adapter` (a generator seeded with
    `seed`), scored (the user's reward functions in `worker`: grpo_rewards.py) and turned into advantages;
    `decoder`: a pipeline's decoding over its stages (`base` then its stage 0). ValueError where an example has no
    prompt; RewardError where a reward fails."""
    rows: list[ScoredRow] = scored_rows(examples, base, None)
    if len(rows) != len(examples):
        raise ValueError(f"job '{adapter}': {len(examples) - len(rows)} of its rows have no prompt before their "
                         "target (a grpo job continues each row's prompt)")
    groups = config.num_generations
    generator = torch.Generator(device=base.device).manual_seed(seed)
    stops = stop_token_ids(base)
    requests = [(adapter, list(row.prompt)) for row in rows for _ in range(groups)]
    outputs = greedy_generate_many(base, requests, config.max_new_tokens, stops,
                                   Sampling(config.temperature, config.top_k, generator,
                                            top_p=config.top_p, min_p=config.min_p), decoder=decoder)
    texts = [_completion_text(base, tokens, stops) for tokens in outputs]
    contexts = [{"prompt": row.prompt_text, "reference": row.reference} for row in rows for _ in range(groups)]
    scores = reward_scores(config, [c["prompt"] for c in contexts], texts, contexts, worker).view(len(rows), groups,
                                                                                                   -1)
    scored = group_scores(config, scores)
    ended = stops | ({base.pad_token_id} if base.pad_token_id is not None else set())   # as TRL tells the ended
    out = []
    for index, row in enumerate(rows):
        completions, truncated = [], []
        for tokens in outputs[index * groups:(index + 1) * groups]:
            cut = bool(tokens) and tokens[-1] not in ended
            targets = (IGNORE_INDEX,) * len(tokens) if cut and config.mask_truncated_completions else tuple(tokens)
            completions.append(Example(tuple(row.prompt) + tuple(tokens), (IGNORE_INDEX,) * len(row.prompt) + targets))
            truncated.append(cut)
        out.append(Rollout(tuple(completions), len(row.prompt), tuple(scored.rewards[index].tolist()),
                           tuple(tuple(each) for each in scores[index].tolist()),
                           tuple(scored.advantages[index].tolist()), tuple(truncated)))
    return out


SAMPLING_SIZES = "lower batch_size, grpo.num_generations, max_seq_len or grpo.max_new_tokens"   # what to lower


def _text_config(base: BaseModel) -> Any:
    config = base.model.config
    return getattr(config, "text_config", None) or config


def kv_bytes_per_token(base: BaseModel) -> int:
    """The bytes one token's keys and values take in the KV cache of sampling: every layer's, in the compute
    dtype (what transformers' DynamicCache holds)."""
    config = _text_config(base)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=base.dtype).element_size()


def sampling_bytes(base: BaseModel, rows: int, width: int, *, layers: int | None = None, logits: bool = True) -> int:
    """What sampling `rows` sequences of up to `width` tokens each (prompt and completion) needs beyond what
    the trainer holds, at most: the KV cache of every token (`kv_bytes_per_token`), its last layer's copy
    while a step appends to it, the prompt pass's hidden states and MLP activations of one layer (no
    gradients are kept while sampling; its attention scores too where the model needs eager attention), the
    padded batch's attention mask (width x width per row), and the last position's logits in float32 three
    times over (the logits, the tempered scores, their softmax). A pipeline stage's: the cache of its `layers`
    only, and the logits where it computes or chooses from them (`logits`: its first and last stages).
    tests/unit/engine/test_grpo.py checks it against the allocator's count, tests/service/test_pipeline_memory.py
    a stage's."""
    config = _text_config(base)
    element = torch.empty((), dtype=base.dtype).element_size()
    layer_cache = kv_bytes_per_token(base) // config.num_hidden_layers * rows * width
    cache = layer_cache * (config.num_hidden_layers if layers is None else layers)
    scores = 2 * config.num_attention_heads * width if needs_eager_attention(base.model) else 0   # sdpa keeps none
    prompt_pass = rows * width * element * (4 * config.hidden_size + 3 * config.intermediate_size + scores)
    mask = rows * width * width * 5   # the padded batch's 4-D attention mask: float32, and its boolean form
    vocabulary = 3 * rows * config.vocab_size * 4 if logits else 0
    return cache + layer_cache + prompt_pass + mask + vocabulary


def sampling_memory_error(base: BaseModel, config: GrpoConfig, batch: Sequence[Example],
                          error: BaseException) -> MemoryError:
    """What a job's sampling that ran out of memory tells its user: what it needed (`sampling_bytes`) and what to
    lower."""
    rows = len(batch) * config.num_generations
    width = max(len(e) for e in batch) + config.max_new_tokens
    return MemoryError(f"sampling its {rows} completions ran out of memory ({error}); they need some "
                       f"{sampling_bytes(base, rows, width) / 2**20:.0f} MiB beside what the trainer holds: "
                       f"{SAMPLING_SIZES}")


def rollout_seed(job: Any, ahead: int = 0) -> int:
    """The generator seed of a GRPO job's next rollout (`ahead`: of the one that many micro-batches later in the
    same accumulation): from its seed and its position (optimizer steps taken, micro-batches of the current
    accumulation), so the same job samples the same completions alone or fused, and again after resuming from a
    checkpoint."""
    position = job.accumulator.micro_batches + ahead
    digest = hashlib.blake2b(f"{job.seed}:{job.step}:{position}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


@dataclass
class CompletionTargets:
    """The GRPO jobs' target tokens of a packed batch: `select` picks them out of the batch's targets,
    `sequence` is each one's completion (0-based over the GRPO jobs' completions, in stream order)."""

    select: torch.Tensor
    sequence: torch.Tensor
    sequences: int
    first_sequence: dict[int, int] = field(default_factory=dict)   # job index in the batch -> its first completion


def completion_targets(batch: FusedBatch, micro_batches: list[JobMicroBatch], jobs: list[int]) -> CompletionTargets:
    """Where the targets of the micro-batches `jobs` (indices into `micro_batches`, whose examples are
    `Rollout`s) lie, by completion."""
    sequence_of_row: list[int] = []
    first: dict[int, int] = {}
    count = 0
    for index, micro_batch in enumerate(micro_batches):
        rows = len(micro_batch.rows)
        if index in jobs:
            if not all(isinstance(example, Rollout) for example in micro_batch.examples):
                raise TypeError(f"job '{micro_batch.job}' is a grpo job but its micro-batch holds no rollouts (its "
                                "prompts were not expanded before the step: FusedTrainer.rollouts)")
            first[index] = count
            sequence_of_row += list(range(count, count + rows))
            count += rows
        else:
            sequence_of_row += [-1] * rows
    select, sequence, _, _ = targets_of_rows(batch, sequence_of_row)
    return CompletionTargets(select, sequence, count, first)


def tempered(transform: LogitTransform, temperature: float) -> LogitTransform:
    """The model's logit transform followed by a division by `temperature` (TRL divides the logits by its
    sampling temperature before their log-softmax)."""
    if temperature == 1.0:
        return transform
    if transform.softcap is not None:
        raise ValueError(f"grpo.temperature {temperature} on a model whose logits are soft-capped: the temperature "
                         "would apply after the cap, which aspen does not compute; use temperature 1.0")
    return replace(transform, divide=transform.divide * temperature)


def grpo_outcome(config: GrpoConfig, logp: torch.Tensor, sequence: torch.Tensor, reference: torch.Tensor | None,
                 batch_rollouts: Sequence[Rollout], old: torch.Tensor | None = None) -> PreferenceOutcome:
    """One GRPO job's objective from its completion tokens' log-probabilities `logp` (at its temperature), each
    token's completion (`sequence`, 0-based over the job's completions in stream order), with beta > 0 the base's
    log-probabilities of the same tokens (`reference`), and where the completions are replayed (num_iterations)
    theirs at their generation (`old`; else `logp` itself, detached). `pairs` of the outcome is what its loss is
    the mean over: completion tokens (dapo) or completions (grpo)."""
    completions = sum(len(r.completions) for r in batch_rollouts)
    advantage = torch.tensor([a for r in batch_rollouts for a in r.advantages], dtype=logp.dtype,
                             device=logp.device)[sequence]
    ratio = torch.exp(logp - (logp.detach() if old is None else old.to(logp.dtype)))
    low, high = 1 - config.epsilon, 1 + config.upper_epsilon
    clipped = torch.clamp(ratio, low, high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    metrics = _clip_ratios(ratio.detach(), advantage, low, high)
    if config.beta:
        if reference is None:
            raise ValueError("a grpo job with beta > 0 needs its reference log-probabilities")
        delta = reference - logp
        kl = (torch.exp(delta) - delta - 1) * ratio   # times the ratio: TRL's use_bias_correction_kl (its default)
        per_token = per_token + config.beta * kl
        metrics["kl"] = float(kl.detach().mean()) if kl.numel() else 0.0
    tokens = int(logp.numel())
    if config.loss_type == "dapo":
        objective, count = per_token.sum(), tokens
    else:
        zeros = torch.zeros(completions, dtype=per_token.dtype, device=per_token.device)
        lengths = zeros.index_add(0, sequence, torch.ones_like(per_token))
        sums = zeros.index_add(0, sequence, per_token)
        objective, count = (sums / lengths.clamp_min(1.0)).sum(), completions
    scores = torch.tensor([r.scores for r in batch_rollouts], dtype=torch.float64)
    lengths = [len(c) - r.prompt_length for r in batch_rollouts for c in r.completions]   # masked ones too
    truncated = [cut for r in batch_rollouts for cut in r.truncated]
    metrics |= {**reward_metrics(config, scores),
                "completions/mean_length": sum(lengths) / max(completions, 1),
                "completions/clipped_ratio": sum(truncated) / max(len(truncated), 1)}
    return PreferenceOutcome(objective, float(objective.detach()) / max(count, 1), count, metrics)


def _clip_ratios(ratio: torch.Tensor, advantage: torch.Tensor, low: float, high: float) -> dict[str, float]:
    """TRL's shares of the completion tokens whose ratio the clipping holds (their gradient stopped): below 1 -
    epsilon with a negative advantage, above 1 + epsilon_high with a positive one, either."""
    if not ratio.numel():
        return {"clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0}
    below = (ratio < low) & (advantage < 0)
    above = (ratio > high) & (advantage > 0)
    shares = torch.stack([below, above, below | above]).to(torch.float32).mean(dim=1).tolist()
    return dict(zip(("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"), shares, strict=True))


@torch.no_grad()
def reference_token_log_probs(base: BaseModel, micro_batch: JobMicroBatch, temperature: float, chunk: int,
                              reference_adapter: str | None = None) -> torch.Tensor:
    """The reference's log-probabilities of a GRPO micro-batch's completion tokens, in the order of its targets (a
    no-grad forward of its sequences alone: the KL term's reference): the base's, no adapter, or those of the job's
    frozen `reference_adapter` (its init_adapter) where it has one."""
    batch = pack([micro_batch], "packed", base.pad_token_id).to(base.device)
    adapters = {micro_batch.job: reference_adapter} if reference_adapter is not None else None
    with step_layout(reference_layout(batch, adapters)):
        hidden = base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    head = base.lm_head
    return target_log_probs(hidden[batch.target_index], head.weight, head.bias, batch.target_ids, chunk,
                            tempered(base.logit_transform, temperature))


def step_rollouts(base: BaseModel, chosen: list[tuple[Any, list[Example]]], functions: FunctionWorker
                  ) -> tuple[list[tuple[Any, list]], list[tuple[Any, Exception]]]:
    """A step's chosen (job, micro-batch) pairs with each GRPO job's prompts expanded into sampled, scored
    completions (`rollouts`, through the job's adapter, seeded by the job's seed and position: the same alone or
    fused), and the GRPO jobs whose reward failed (RewardError), whose rows have no prompt (ValueError) or whose
    sampling ran out of memory, each with its error (the others' step goes on)."""
    kept: list[tuple[Any, list]] = []
    failed: list[tuple[Any, Exception]] = []
    for job, batch in chosen:
        if job.spec.grpo is None or job.replaying:   # a replayed micro-batch is its generation's rollouts
            kept.append((job, batch))
            continue
        try:
            expanded = rollouts(base, job.name, job.spec.grpo, batch, rollout_seed(job), functions)
        except (RewardError, ValueError) as error:
            failed.append((job, error))
            continue
        except torch.OutOfMemoryError as error:   # its sampling alone: the others' step goes on
            failed.append((job, sampling_memory_error(base, job.spec.grpo, batch, error)))
            continue
        kept.append((job, expanded))
    return kept, failed
