"""Sampling as the Tinker API defines it (its `SamplingParams` and `SampleResponse`), batched over adapters
through aspen's KV-cache decoding (actors/engine/generate.py): `num_samples` continuations of a prompt, each
token drawn from softmax(logits / temperature) among the `top_k` likeliest (-1: all) and the smallest set
whose probability reaches `top_p`, temperature 0 taking the likeliest; each with the log-probability of every
sampled token under the model itself (temperature 1, the distribution `forward` scores), ending at a stop
token or a stop string (kept in the tokens, reason "stop") or after `max_tokens` (reason "length").

Every sample draws from a generator of its own, seeded from the call's seed and its index: the same seed, the
same samples, whatever else shares the batch. Without a seed, a random one.

For each sampled token the `topk_sample` likeliest at that step with their log-probabilities; what a call asks of
its prompt (its log-probabilities, top-k, chosen tokens' log-probabilities, alternative draws) comes from one
forward over it through the same adapter (actors/engine/prompt_scores.py). Every log-probability is under the
model itself."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from actors.engine.generate import SlicedDecoding, kept_probabilities
from actors.engine.models import BaseModel
from actors.engine.prompt_scores import PromptScores, TargetCells, check_prompt_asks, score_prompt


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
    target_cells: TargetCells | None = None   # token ids whose log-probabilities at prompt positions to give
    alt_k: int = 0                       # draws from the model's distribution at each prompt position (0: none)

    @property
    def scores_prompt(self) -> bool:
        return bool(self.prompt_logprobs or self.topk_prompt or self.target_cells is not None or self.alt_k)


@dataclass
class Sampled:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    topk: list[tuple[list[int], list[float]]] = field(default_factory=list)   # per token, with topk_sample


@dataclass
class SampleResult:
    sequences: list[Sampled]
    prompt: PromptScores | None = None   # what the call asked of its prompt (actors/engine/prompt_scores.py)

    @property
    def prompt_logprobs(self) -> list[float | None] | None:
        return self.prompt.logprobs if self.prompt is not None else None

    @property
    def topk_prompt(self) -> list[tuple[list[int], list[float]] | None] | None:
        return self.prompt.topk if self.prompt is not None else None


def check_sample(call: SampleCall, vocab_size: int, context: int | None = None) -> None:
    """A call the base can answer (ValueError saying what is wrong): the positions its decoding feeds the base
    within `context`, as a forward_backward datum's must be. `max_tokens` tokens after a prompt of n feed n +
    max_tokens - 1 positions: the prompt, then each sampled token but the last (which is never fed), so a prompt of
    the whole context samples one token (what compute_logprobs asks)."""
    if not call.prompt:
        raise ValueError("the prompt is empty")
    fed = len(call.prompt) + call.max_tokens - 1
    room = context - len(call.prompt) + 1 if context is not None else 0
    if context is not None and fed > context:
        raise ValueError(f"the prompt has {len(call.prompt)} tokens and max_tokens is {call.max_tokens}: "
                         f"{fed} positions fed (the prompt, then each sampled token but the last), past the base's "
                         f"context of {context}; shorten the prompt or ask for at most "
                         f"{room} token{'s' if room > 1 else ''}"
                         if len(call.prompt) <= context else
                         f"the prompt has {len(call.prompt)} tokens; the base's context is {context}: shorten it")
    if min(call.prompt) < 0 or max(call.prompt) >= vocab_size:
        raise ValueError(f"the prompt holds a token outside the base's vocabulary (0..{vocab_size - 1})")
    if call.num_samples < 1 or call.max_tokens < 1:
        raise ValueError("num_samples and max_tokens must be at least 1")
    if call.temperature < 0 or not 0 < call.top_p <= 1 or call.top_k == 0 or call.top_k < -1:
        raise ValueError("sampling_params: temperature >= 0, 0 < top_p <= 1, top_k -1 (all) or >= 1")
    if not 0 <= call.topk_sample <= vocab_size:
        raise ValueError(f"topk_sample_logprobs must be 0..{vocab_size} (the vocabulary)")
    check_prompt_asks(call, vocab_size)


def row_seed(seed: int, index: int) -> int:
    """Sample `index`'s generator seed from the call's: distinct per sample, within torch's 64-bit seeds."""
    return (seed * 0x9E3779B97F4A7C15 + index) & ((1 << 63) - 1)


def pick(logits: torch.Tensor, call: SampleCall, generator: torch.Generator) -> int:
    """One token from a row's logits (float32) as the call's parameters say."""
    if call.temperature == 0:
        return int(logits.argmax())
    weights = kept_probabilities(logits / call.temperature, call.top_k, call.top_p)
    return int(torch.multinomial(weights, 1, generator=generator))


class SampleRun:
    """Every call's samples decoding in one batch, in slices (`advance`: a trainer runs other passes between them;
    the same tokens however it is sliced, each row drawing from its own generator); `results()` once done.
    `decode_text`: tokens to text, for stop strings."""

    def __init__(self, base: BaseModel, calls: list[SampleCall],
                 decode_text: Callable[[list[int]], str] | None = None):
        vocab = int(base.lm_head.weight.shape[0])
        for call in calls:
            check_sample(call, vocab)
            if call.stop_texts and decode_text is None:
                raise ValueError("stop strings need the base's tokenizer, which this base lacks; give stop token ids")
        self.base, self.calls, self.decode_text = base, calls, decode_text
        self.rows = [(call, index) for call in calls for index in range(call.num_samples)]
        self.seeds = {id(call): call.seed if call.seed is not None else secrets.randbits(62) for call in calls}
        self.generators = [torch.Generator(device=base.device).manual_seed(row_seed(self.seeds[id(call)], index))
                           for call, index in self.rows]
        self.outputs = [Sampled() for _ in self.rows]
        self.decoding = (SlicedDecoding(base, [(call.adapter, call.prompt) for call, _ in self.rows], self._choose,
                                        self._finished) if self.rows else None)

    @property
    def adapters(self) -> frozenset[str]:
        """The adapters its rows decode through (not to be taken off the base before it ends)."""
        return self.decoding.adapters if self.decoding is not None else frozenset()

    def advance(self, seconds: float | None = None) -> bool:
        """Decode on: to the end (`seconds` None), or one token at least and then until `seconds` have passed;
        whether every sample has ended."""
        return self.decoding is None or self.decoding.advance(seconds)

    def held_bytes(self) -> int:
        """What its KV cache will hold at its longest (its present size grown to every row's last token)."""
        if self.decoding is None or not self.decoding.cached_tokens:
            return 0
        longest = self.decoding.loop.batch.input_ids.shape[1] + max(call.max_tokens for call in self.calls)
        return self.decoding.cache_bytes() * longest // self.decoding.cached_tokens

    def _choose(self, logits: torch.Tensor) -> list[int]:
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = []
        for row, (call, _) in enumerate(self.rows):
            token = pick(logits[row], call, self.generators[row])
            self.outputs[row].logprobs.append(float(logprobs[row, token]))
            if call.topk_sample:
                values, ids = logprobs[row].topk(call.topk_sample)
                self.outputs[row].topk.append((ids.tolist(), values.tolist()))
            tokens.append(token)
        return tokens

    def _finished(self, row: int, token: int) -> bool:
        call, output = self.rows[row][0], self.outputs[row]
        output.tokens.append(token)
        stopped = token in call.stop_tokens or (
            bool(call.stop_texts) and any(self.decode_text(output.tokens).endswith(s) for s in call.stop_texts))
        if stopped:
            output.stop_reason = "stop"
        return stopped or len(output.tokens) >= call.max_tokens

    @torch.no_grad()
    def results(self) -> list[SampleResult]:
        """Each call's samples (and what it asked of its prompt), once `advance` has said every one has ended."""
        for output in self.outputs:   # a row that ended earlier than the batch drew logprobs it did not take
            del output.logprobs[len(output.tokens):]
            del output.topk[len(output.tokens):]
        results, start = [], 0
        for call in self.calls:
            sequences = self.outputs[start:start + call.num_samples]
            start += call.num_samples
            result = SampleResult(sequences)
            if call.scores_prompt:
                result.prompt = score_prompt(self.base, call, self.seeds[id(call)])
            results.append(result)
        return results


def sample(base: BaseModel, calls: list[SampleCall],
           decode_text: Callable[[list[int]], str] | None = None) -> list[SampleResult]:
    """Every call's samples in one decoding batch, decoded to the end. `decode_text`: tokens to text, for stop
    strings."""
    run = SampleRun(base, calls, decode_text)
    run.advance()
    return run.results()
