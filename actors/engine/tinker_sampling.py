"""Sampling as the Tinker API defines it (its `SamplingParams` and `SampleResponse`), batched over adapters
through aspen's KV-cache decoding (actors/engine/generate.py): `num_samples` continuations of a prompt, each
token drawn from softmax(logits / temperature) among the `top_k` likeliest (-1: all) and the smallest set
whose probability reaches `top_p`, temperature 0 taking the likeliest; each with the log-probability of every
sampled token under the model itself (temperature 1, the distribution `forward` scores), ending at a stop
token or a stop string (kept in the tokens, reason "stop") or after `max_tokens` (reason "length").

Every sample draws from a generator of its own, seeded from the call's seed and its index: the same seed, the
same samples, whatever else shares the batch. Without a seed, a random one.

Scores of the prompt, from one forward over it through the same adapter: the log-probability of each prompt token
(`prompt_logprobs`), the `topk_prompt` likeliest tokens at each position with theirs (top-k distillation's
teacher), both only over the last `prompt_last_n` positions where given (earlier ones unscored); and for each
sampled token the `topk_sample` likeliest at that step. Every log-probability is under the model itself."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from actors.engine.generate import BASE_ONLY, decode, kept_probabilities
from actors.engine.layout import StepLayout, step_layout
from actors.engine.loss import target_log_probs, transform_logits
from actors.engine.models import BaseModel


@dataclass(frozen=True)
class SampleCall:
    adapter: str | None                  # None: the base alone
    prompt: tuple[int, ...]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: frozenset[int] = frozenset()
    stop_texts: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    topk_prompt: int = 0                 # the k likeliest tokens at each prompt position (0: none)
    topk_sample: int = 0                 # the k likeliest tokens at each sampled token's step (0: none)
    prompt_last_n: int | None = None     # score only the prompt's last n positions (None: all but the first)


@dataclass
class Sampled:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)   # per token, with topk_sample


@dataclass
class SampleResult:
    sequences: list[Sampled]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: list[tuple[list[int], list[float]] | None] | None = None   # per prompt position (None: unscored)


def check_sample(call: SampleCall, vocab_size: int) -> None:
    if not call.prompt:
        raise ValueError("the prompt is empty")
    if min(call.prompt) < 0 or max(call.prompt) >= vocab_size:
        raise ValueError(f"the prompt holds a token outside the base's vocabulary (0..{vocab_size - 1})")
    if call.num_samples < 1 or call.max_tokens < 1:
        raise ValueError("num_samples and max_tokens must be at least 1")
    if call.temperature < 0 or not 0 < call.top_p <= 1 or call.top_k == 0 or call.top_k < -1:
        raise ValueError("sampling_params: temperature >= 0, 0 < top_p <= 1, top_k -1 (all) or >= 1")
    if not 0 <= call.topk_prompt <= vocab_size or not 0 <= call.topk_sample <= vocab_size:
        raise ValueError(f"topk_prompt_logprobs and topk_sample_logprobs must be 0..{vocab_size} (the vocabulary)")
    if call.prompt_last_n is not None and not 1 <= call.prompt_last_n <= len(call.prompt) - 1:
        raise ValueError(f"prompt_logprobs_last_n must be 1..{len(call.prompt) - 1} (the prompt's tokens after its "
                         f"first), got {call.prompt_last_n}")


def row_seed(seed: int, index: int) -> int:
    """Sample `index`'s generator seed from the call's: distinct per sample, within torch's 64-bit seeds."""
    return (seed * 0x9E3779B97F4A7C15 + index) & ((1 << 63) - 1)


def pick(logits: torch.Tensor, call: SampleCall, generator: torch.Generator) -> int:
    """One token from a row's logits (float32) as the call's parameters say."""
    if call.temperature == 0:
        return int(logits.argmax())
    weights = kept_probabilities(logits / call.temperature, call.top_k, call.top_p)
    return int(torch.multinomial(weights, 1, generator=generator))


@torch.no_grad()
def sample(base: BaseModel, calls: list[SampleCall],
           decode_text: Callable[[list[int]], str] | None = None) -> list[SampleResult]:
    """Every call's samples in one decoding batch. `decode_text`: tokens to text, for stop strings."""
    vocab = int(base.lm_head.weight.shape[0])
    for call in calls:
        check_sample(call, vocab)
        if call.stop_texts and decode_text is None:
            raise ValueError("stop strings need the base's tokenizer, which this base lacks; give stop token ids")
    rows = [(call, index) for call in calls for index in range(call.num_samples)]
    seeds = {id(call): call.seed if call.seed is not None else secrets.randbits(62) for call in calls}
    generators = [torch.Generator(device=base.device).manual_seed(row_seed(seeds[id(call)], index))
                  for call, index in rows]
    outputs = [Sampled() for _ in rows]

    def choose(logits: torch.Tensor) -> list[int]:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = []
        for row, (call, _) in enumerate(rows):
            token = pick(logits[row], call, generators[row])
            outputs[row].logprobs.append(float(logprobs[row, token]))
            if call.topk_sample:
                values, ids = logprobs[row].topk(call.topk_sample)
                outputs[row].topk.append((ids.tolist(), values.tolist()))
            tokens.append(token)
        return tokens

    def finished(row: int, token: int) -> bool:
        call, output = rows[row][0], outputs[row]
        output.tokens.append(token)
        stopped = token in call.stop_tokens or (
            bool(call.stop_texts) and any(decode_text(output.tokens).endswith(s) for s in call.stop_texts))
        if stopped:
            output.stop_reason = "stop"
        return stopped or len(output.tokens) >= call.max_tokens

    if rows:
        decode(base, [(call.adapter, call.prompt) for call, _ in rows], choose, finished)
    for output in outputs:   # a row that ended earlier than the batch drew logprobs it did not take
        del output.logprobs[len(output.tokens):]
        del output.topk[len(output.tokens):]
    results, start = [], 0
    for call in calls:
        sequences = outputs[start:start + call.num_samples]
        start += call.num_samples
        result = SampleResult(sequences)
        if call.prompt_logprobs or call.topk_prompt:
            result.prompt_logprobs, result.topk_prompt = prompt_scores(base, call)
            if not call.prompt_logprobs:
                result.prompt_logprobs = None
        results.append(result)
    return results


TOPK_CHUNK = 1024   # prompt positions whose full logits are held at once for their top-k


def prompt_scores(base: BaseModel, call: SampleCall
                  ) -> tuple[list[float | None], list[tuple[list[int], list[float]] | None] | None]:
    """log p(prompt[i] | prompt[:i]) at each scored position of the prompt (None at position 0 and before the
    last `prompt_last_n`), and with `topk_prompt` the k likeliest tokens there with their log-probabilities
    (the same positions: the distribution prompt[i] is drawn from, given prompt[:i])."""
    ids = torch.tensor(call.prompt, device=base.device)
    layout = StepLayout.single(call.adapter or BASE_ONLY, [len(call.prompt)])
    with step_layout(layout):
        hidden = base.decoder(input_ids=ids[None], position_ids=torch.arange(len(ids), device=base.device)[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    first = len(ids) - call.prompt_last_n if call.prompt_last_n is not None else 1   # the first scored position
    head = base.lm_head
    values = target_log_probs(hidden[first - 1:-1], head.weight, head.bias, ids[first:],
                              transform=base.logit_transform)
    logprobs: list[float | None] = [None] * first + [float(v) for v in values]
    if not call.topk_prompt:
        return logprobs, None
    topk: list[tuple[list[int], list[float]] | None] = [None] * first
    for start in range(first - 1, len(ids) - 1, TOPK_CHUNK):
        rows = hidden[start:min(start + TOPK_CHUNK, len(ids) - 1)]
        scores = torch.log_softmax(transform_logits(head(rows).float(), base.logit_transform), dim=-1)
        best, tokens = scores.topk(call.topk_prompt, dim=-1)
        topk.extend(zip(tokens.tolist(), best.tolist(), strict=True))
    return logprobs, topk
