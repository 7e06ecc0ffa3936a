"""Batched decoding with a KV cache, each prompt through its own adapter (or the base model alone): greedy,
or sampled (`Sampling`: temperature, top-k, a seeded generator).

One forward per new token for the whole batch: the prompts are left-padded into rows grouped by adapter,
prefilled once into transformers' `DynamicCache`, then each step feeds one token per row. The fused LoRA
layers see a `StepLayout` whose segments are the adapter groups' rows (a (rows, T) batch flattens row by
row, so each group's tokens are contiguous), so several adapters decode in one pass, each exactly through
its own weights. Attention runs as the model's `sdpa` (or `eager`, for soft-capping and sinks) with the
padding mask, for the duration of the call; the varlen attention of fused steps needs no cache and no mask.

Used by the generation metrics of evaluations (actors/engine/generation_eval.py), by GRPO jobs' rollouts
(actors/engine/grpo.py) and by the demo."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.experts_lora import job_adapters
from actors.engine.fused_linear import FusedLoraLinear
from actors.engine.head_logits import row_logits
from actors.engine.head_lora import held_names
from actors.engine.layout import StepLayout, step_layout
from actors.engine.models import BaseModel

BASE_ONLY = "__base__"
"""A segment name attached to no layer: tokens under it go through the base model alone."""


def _adapter_training_states(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    return [(module.adapters, module.adapters.training) for module in model.modules()
            if isinstance(module, FusedLoraLinear)]


def _attached(model: nn.Module) -> set[str]:
    """The adapters on the model: on its linear layers, or on its expert stacks alone (experts_lora.py)."""
    return ({name for m in model.modules() if isinstance(m, FusedLoraLinear) for name in m.adapters}
            | {name for m in model.modules() if (held := job_adapters(m)) is not None for name in held}
            | held_names(model))


def needs_eager_attention(model: nn.Module) -> bool:
    """Attention features sdpa does not have: soft-capping (Gemma 2) and sink logits (gpt-oss)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "attn_logit_softcapping", None)) or getattr(config, "model_type", "") == "gpt_oss"


@contextlib.contextmanager
def _masked_attention(model: nn.Module) -> Iterator[None]:
    """The model's own masked attention for the call (a padded batch with a cache), its own one after."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before is None or not hasattr(model, "set_attn_implementation"):
        yield
        return
    # sdpa where the model's class has it (GraniteSWA has none: eager)
    sdpa = getattr(type(model), "_supports_sdpa", True) and not needs_eager_attention(model)
    model.set_attn_implementation("sdpa" if sdpa else "eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def kept_probabilities(scores: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The next-token weights along the last dimension of `scores` (logits over the temperature): their softmax among
    the tokens kept, zero elsewhere (not normalised again: what `torch.multinomial` takes). Kept, in transformers'
    order of warpers: the `top_k` likeliest (0 or less: all), then the smallest set whose probability reaches `top_p`
    (the tokens whose likelier ones hold less than it), then those at least `min_p` times as likely as the likeliest;
    the likeliest is always kept."""
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    if top_p < 1:
        ordered, indices = torch.sort(probabilities, dim=-1, descending=True)
        before = torch.cumsum(ordered, dim=-1) - ordered   # the mass of the likelier tokens
        ordered = ordered.masked_fill(before >= top_p, 0.0)   # the likeliest is always kept
        probabilities = torch.zeros_like(probabilities).scatter(-1, indices, ordered)
    if min_p > 0:
        floor = min_p * probabilities.amax(dim=-1, keepdim=True)
        probabilities = probabilities.masked_fill(probabilities < floor, 0.0)
    return probabilities


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding: each next token drawn from softmax(logits / temperature) among the tokens `top_k`, `top_p`
    and `min_p` keep (`kept_probabilities`), with `generator` (seeded by the caller: the same seed, the same
    tokens)."""

    temperature: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None
    top_p: float = 1.0
    min_p: float = 0.0

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        weights = kept_probabilities(logits.float() / self.temperature, self.top_k, self.top_p, self.min_p)
        return torch.multinomial(weights, 1, generator=self.generator).squeeze(-1)


def _row_layout(groups: list[tuple[str, int, int]], width: int, rows: int) -> StepLayout:
    """Adapter segments over a (rows, width) batch; no packed sequences (attention takes the mask)."""
    segments = tuple((name, first * width, end * width) for name, first, end in groups)
    return StepLayout(segments, (), rows * width)


Decoder = Callable[[Sequence[tuple[str | None, Sequence[int]]], Callable[[torch.Tensor], list[int]],
                    Callable[[int, int], bool]], None]
"""A decoding loop's runner, `decode`'s signature without the base: one device's (`decode`), or a pipeline's over
its stages (actors/engine/pipeline/stage_generation.py)."""


@torch.no_grad()
def greedy_generate_many(base: BaseModel, requests: Sequence[tuple[str | None, Sequence[int]]],
                         max_new_tokens: int, stop_token_ids: set[int],
                         sampling: Sampling | None = None, decoder: Decoder | None = None,
                         stop: Callable[[], bool] | None = None) -> list[list[int]]:
    """Greedy continuations of `(adapter, prompt)` requests in one batch (adapter None: the base alone), or
    sampled ones with `sampling`; `decoder`: who runs the decoding loop (default: `decode` on `base`).

    Returns, per request in the given order, the generated tokens only; a sequence ends after
    `max_new_tokens` tokens or at the first token in `stop_token_ids`, which is kept as its last token
    (as `transformers` `generate` keeps the EOS token). `stop`: asked once per decode step; once it says True,
    every sequence ends there (the tokens so far returned), as the loop ends at its last sequence's end."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    outputs: list[list[int]] = [[] for _ in requests]
    if max_new_tokens == 0 or not requests:
        if decoder is None:
            check_requests(base, requests)
        return outputs

    stopped = False

    def choose(logits: torch.Tensor) -> list[int]:
        nonlocal stopped
        stopped = stopped or (stop is not None and stop())
        return (logits.argmax(dim=-1) if sampling is None else sampling.pick(logits)).tolist()

    def finished(index: int, token: int) -> bool:
        if stopped:   # this step's token is not taken: the sequence ends where it was stopped
            return True
        outputs[index].append(token)
        return token in stop_token_ids or len(outputs[index]) >= max_new_tokens

    if decoder is None:
        decode(base, requests, choose, finished)
    else:
        decoder(requests, choose, finished)
    return outputs


def check_requests(base: BaseModel, requests: Sequence[tuple[str | None, Sequence[int]]]) -> None:
    for index, (_, prompt) in enumerate(requests):
        if not prompt:
            raise ValueError(f"prompt {index} is empty; greedy decoding needs at least one token")
    attached = _attached(base.model)
    for adapter in {adapter for adapter, _ in requests if adapter is not None}:
        if adapter not in attached:
            raise ValueError(f"no adapter named '{adapter}' is attached to the model")


@dataclass
class DecodeBatch:
    """Requests as one left-padded decoding batch: rows grouped by adapter (stable within a group: `order[row]` is
    the request in that row), so each adapter's tokens are one contiguous segment (`groups`: name, first row, end
    row); the prompts' ids, their attention mask and positions."""

    order: list[int]
    groups: list[tuple[str, int, int]]
    input_ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor

    @property
    def rows(self) -> int:
        return len(self.order)

    def layout(self, width: int) -> StepLayout:
        """The adapters' segments over this step's (rows, width) feed."""
        return _row_layout(self.groups, width, self.rows)

    def step(self, device: torch.device, active: Sequence[bool] | None = None) -> None:
        """Past one more token in every row: the mask one column longer, the positions the next; a row not
        `active` (its sequence ended, its logits no longer taken) keeps its last position, so that it is never fed
        one past what its request was checked for (a base with learned positions has none there)."""
        self.mask = torch.cat([self.mask, torch.ones((self.rows, 1), dtype=self.mask.dtype, device=device)], dim=1)
        last = self.positions[:, -1:]
        self.positions = last + (1 if active is None else torch.tensor(active, device=device)[:, None].long())


def decode_batch(requests: Sequence[tuple[str | None, Sequence[int]]], pad_token_id: int,
                 device: torch.device) -> DecodeBatch:
    order = sorted(range(len(requests)), key=lambda i: (requests[i][0] is not None, requests[i][0] or ""))
    groups: list[tuple[str, int, int]] = []
    for row, index in enumerate(order):
        name = requests[index][0] or BASE_ONLY
        if groups and groups[-1][0] == name:
            groups[-1] = (name, groups[-1][1], row + 1)
        else:
            groups.append((name, row, row + 1))
    rows = len(order)
    width = max(len(requests[i][1]) for i in order)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    for row, index in enumerate(order):
        prompt = list(requests[index][1])
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
        mask[row, width - len(prompt):] = 1
    return DecodeBatch(order, groups, input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))


def cache_keyword(decoder: nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x; the old name warns): whichever `decoder` takes."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


@contextlib.contextmanager
def decoding(model: nn.Module) -> Iterator[None]:
    """The adapters in eval mode (no dropout) and the model's own masked attention, for a decoding call."""
    states = _adapter_training_states(model)
    set_adapters_training(model, False)
    try:
        with _masked_attention(model):
            yield
    finally:
        for adapters, training in states:
            adapters.train(training)


class DecodeLoop:
    """The decoding loop over `batch`, one step at a time (`step`): `forward(feed)` gives the rows' last-position
    logits for this step's feed (the batch's mask and positions as they are), `choose` picks each request's next
    token (logits in request order), `finished(request index, token)` takes it and says whether that sequence has
    ended. `go_on(more)`: told after each step whether another follows (a pipeline's stages)."""

    def __init__(self, batch: DecodeBatch, forward: Callable[[torch.Tensor], torch.Tensor],
                 choose: Callable[[torch.Tensor], list[int]], finished: Callable[[int, int], bool],
                 device: torch.device, go_on: Callable[[bool], None] | None = None):
        self.batch, self.forward, self.choose, self.finished = batch, forward, choose, finished
        self.device, self.go_on = device, go_on
        self.active = [True] * batch.rows
        self.unorder = torch.tensor(sorted(range(batch.rows), key=lambda row: batch.order[row]), device=device)
        self.feed = batch.input_ids
        self.more = True

    def step(self) -> bool:
        """One more token in every row; whether any sequence goes on."""
        logits = self.forward(self.feed)
        by_request = self.choose(logits[self.unorder])   # in request order
        chosen = [by_request[index] for index in self.batch.order]
        for row, index in enumerate(self.batch.order):
            if self.active[row] and self.finished(index, int(chosen[row])):
                self.active[row] = False
        self.more = any(self.active)
        if self.go_on is not None:
            self.go_on(self.more)
        if self.more:
            self.feed = torch.tensor(chosen, dtype=torch.long, device=self.device)[:, None]
            self.batch.step(self.device, self.active)
        return self.more


def run_decoding(batch: DecodeBatch, forward: Callable[[torch.Tensor], torch.Tensor],
                 choose: Callable[[torch.Tensor], list[int]], finished: Callable[[int, int], bool],
                 device: torch.device, go_on: Callable[[bool], None] | None = None) -> None:
    """`DecodeLoop` run until every sequence has ended."""
    loop = DecodeLoop(batch, forward, choose, finished, device, go_on)
    while loop.step():
        pass


class SlicedDecoding:
    """The decoding loop on one device, run in slices (`advance`): between two, the model is its owner's again (its
    adapters' training mode, its own attention: a trainer runs other passes there), the KV cache kept for the next.
    `choose` and `finished` as `DecodeLoop` takes them."""

    def __init__(self, base: BaseModel, requests: Sequence[tuple[str | None, Sequence[int]]],
                 choose: Callable[[torch.Tensor], list[int]], finished: Callable[[int, int], bool]):
        check_requests(base, requests)
        from transformers import DynamicCache  # transformers is imported by the model already

        self.base = base
        batch = decode_batch(requests, base.pad_token_id, base.device)
        self.cache = DynamicCache(config=getattr(base.model, "config", None))
        keyword = cache_keyword(base.decoder)

        def forward(feed: torch.Tensor) -> torch.Tensor:
            with step_layout(batch.layout(feed.shape[1])):
                hidden = base.decoder(input_ids=feed, attention_mask=batch.mask, position_ids=batch.positions,
                                      use_cache=True, **{keyword: self.cache}).last_hidden_state
            return row_logits(base, hidden[:, -1], batch.groups)

        self.loop = DecodeLoop(batch, forward, choose, finished, base.device)
        self.adapters = frozenset(name for name, _, _ in batch.groups if name != BASE_ONLY)

    @property
    def done(self) -> bool:
        return not self.loop.more

    @torch.no_grad()
    def advance(self, seconds: float | None = None) -> bool:
        """Decode until every sequence has ended (`seconds` None), or for one token at least and then until
        `seconds` have passed; whether every sequence has ended."""
        started = time.monotonic()
        with decoding(self.base.model):
            while self.loop.more and self.loop.step():
                if seconds is not None and time.monotonic() - started >= seconds:
                    break
        return self.done

    def cache_bytes(self) -> int:
        """What the KV cache holds now."""
        return sum(value.numel() * value.element_size() for layer in getattr(self.cache, "layers", ())
                   for value in vars(layer).values() if isinstance(value, torch.Tensor))

    @property
    def cached_tokens(self) -> int:
        """The positions the KV cache holds now (each row's prompt, left-padded, and its tokens so far)."""
        return int(self.cache.get_seq_length())


def decode(base: BaseModel, requests: Sequence[tuple[str | None, Sequence[int]]],
           choose: Callable[[torch.Tensor], list[int]], finished: Callable[[int, int], bool]) -> None:
    """The decoding loop on one device: `choose(logits)` picks each row's next token from its logits (rows in
    request order), `finished(request index, token)` takes it and says whether that request's sequence has ended.
    Stops when every sequence has."""
    SlicedDecoding(base, requests, choose, finished).advance()


def greedy_generate(base: BaseModel, adapter: str | None, prompts: list[list[int]], max_new_tokens: int,
                    stop_token_ids: set[int]) -> list[list[int]]:
    """Greedy continuations of `prompts`, all through `adapter` (None: the base model alone); see
    `greedy_generate_many`."""
    return greedy_generate_many(base, [(adapter, prompt) for prompt in prompts], max_new_tokens, stop_token_ids)
