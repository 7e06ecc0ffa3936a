"""What a sampling call asks of its prompt (the Tinker API's `SampleRequest`), from one forward over the prompt
through the call's adapter (or the base alone), position i scored by the distribution prompt[i] is drawn from,
given prompt[:i]:

- `prompt_logprobs`: log p(prompt[i]) at each position after the first (or the last `prompt_last_n`);
- `topk_prompt`: the k likeliest tokens there with their log-probabilities (top-k distillation's teacher);
- `target_cells` (`target_prompt_logprobs`): the log-probabilities of chosen token ids at chosen positions (a
  classifier's labels at the answer position, as tinker-cookbook's `decisions` asks them), answered in the layout
  they were asked in (dense, or sparse CSR);
- `alt_k` (`prompt_alt_tokens_k`): k independent draws at the call's temperature from the distribution at each
  position after the first, with the model's log-probability of each (temperature 0: the likeliest, k times).

Every log-probability is under the model itself (temperature 1). Full logits are held for at most `CHUNK`
positions at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from actors.engine.generate import BASE_ONLY
from actors.engine.head_logits import log_probs
from actors.engine.head_logits import logits as head_logits
from actors.engine.layout import StepLayout, step_layout
from actors.engine.models import BaseModel

CHUNK = 1024   # prompt positions whose full logits are held at once (top-k, alternative draws)
ALT_STREAM = 1 << 40   # the alternative draws' generator: the call's seed, a stream of its own


@dataclass(frozen=True)
class TargetCells:
    """`target_prompt_logprobs` as asked: its (rows, columns) shape (rows: the prompt's positions after the first,
    row i scoring position i + 1), the cells asked for as (row, column, token id) in row-major order, and the
    request's CSR layout (crow indices, column indices) to answer in, or None for a dense answer."""

    shape: tuple[int, int]
    cells: tuple[tuple[int, int, int], ...]
    sparse: tuple[tuple[int, ...], tuple[int, ...]] | None = None


class PromptAsks(Protocol):
    """What of a sampling call (`tinker_sampling.SampleCall`) its prompt's scores read."""

    adapter: str | None
    prompt: tuple[int, ...]
    temperature: float
    prompt_logprobs: bool
    topk_prompt: int
    prompt_last_n: int | None
    target_cells: TargetCells | None
    alt_k: int


@dataclass
class PromptScores:
    logprobs: list[float | None] | None = None                          # per position (None: unscored)
    topk: list[tuple[list[int], list[float]] | None] | None = None       # per position (None: unscored)
    target: tuple[TargetCells, list[float]] | None = None                # each asked cell's log-probability
    alt: tuple[list[list[int]], list[list[float]]] | None = None         # (len - 1, k) tokens and log-probabilities


def check_prompt_asks(call: PromptAsks, vocab_size: int) -> None:
    """ValueError naming what of the prompt's asks cannot be answered."""
    length = len(call.prompt)
    if not 0 <= call.topk_prompt <= vocab_size:
        raise ValueError(f"topk_prompt_logprobs must be 0..{vocab_size} (the vocabulary)")
    if call.prompt_last_n is not None and not 1 <= call.prompt_last_n <= length - 1:
        raise ValueError(f"prompt_logprobs_last_n must be 1..{length - 1} (the prompt's tokens after its first), "
                         f"got {call.prompt_last_n}")
    if call.alt_k < 0 or call.alt_k > 1024:
        raise ValueError(f"prompt_alt_tokens_k must be 0..1024, got {call.alt_k}")
    target = call.target_cells
    if target is not None:
        if target.shape[0] != length - 1:
            raise ValueError(f"target_prompt_logprobs has {target.shape[0]} rows; it needs one per prompt position "
                             f"after the first ({length - 1})")
        for row, column, token in target.cells:
            if not (0 <= row < target.shape[0] and 0 <= column < target.shape[1]):
                raise ValueError(f"target_prompt_logprobs: cell ({row}, {column}) is outside its shape {target.shape}")
            if not 0 <= token < vocab_size:
                raise ValueError(f"target_prompt_logprobs: cell ({row}, {column}) asks for token {token}, outside "
                                 f"the vocabulary (0..{vocab_size - 1}; -1 asks for nothing)")


@torch.no_grad()
def score_prompt(base: BaseModel, call: PromptAsks, seed: int) -> PromptScores:
    """What `call` asks of its prompt (`check_prompt_asks` passed). `seed`: the call's, for alternative draws."""
    ids = torch.tensor(call.prompt, device=base.device)
    layout = StepLayout.single(call.adapter or BASE_ONLY, [len(call.prompt)])
    with step_layout(layout):
        hidden = base.decoder(input_ids=ids[None], position_ids=torch.arange(len(ids), device=base.device)[None],
                              attention_mask=None, use_cache=False).last_hidden_state[0]
    scores = PromptScores()
    first = len(ids) - call.prompt_last_n if call.prompt_last_n is not None else 1   # the first scored position
    if call.prompt_logprobs:
        values = log_probs(base, hidden[first - 1:-1], ids[first:], call.adapter)
        scores.logprobs = [None] * first + [float(v) for v in values]
    if call.target_cells is not None:
        cells = call.target_cells.cells
        rows = torch.tensor([row for row, _, _ in cells], dtype=torch.long, device=hidden.device)
        tokens = torch.tensor([token for _, _, token in cells], dtype=torch.long, device=hidden.device)
        values = log_probs(base, hidden.index_select(0, rows), tokens, call.adapter)
        scores.target = (call.target_cells, [float(v) for v in values])
    if call.topk_prompt or call.alt_k:
        _full_distributions(scores, hidden, call, first, seed, base)
    return scores


def _full_distributions(scores: PromptScores, hidden: torch.Tensor, call: PromptAsks, first: int, seed: int,
                        base: BaseModel) -> None:
    """Top-k (from `first`) and alternative draws (from position 1), a chunk of positions' logits at a time."""
    length = hidden.shape[0]
    generator = torch.Generator(device=hidden.device).manual_seed((seed + ALT_STREAM) & ((1 << 63) - 1))
    if call.topk_prompt:
        scores.topk = [None] * first
    if call.alt_k:
        scores.alt = ([], [])
    start_at = 0 if call.alt_k else first - 1   # alternative draws cover every position after the first
    for start in range(start_at, length - 1, CHUNK):
        rows = hidden[start:min(start + CHUNK, length - 1)]
        logits = head_logits(base, rows, call.adapter)
        logprobs = torch.log_softmax(logits, dim=-1)
        if call.topk_prompt:
            kept = slice(max(first - 1 - start, 0), None)
            best, tokens = logprobs[kept].topk(call.topk_prompt, dim=-1)
            scores.topk.extend(zip(tokens.tolist(), best.tolist(), strict=True))
        if call.alt_k:
            if call.temperature == 0:
                drawn = logits.argmax(dim=-1, keepdim=True).expand(-1, call.alt_k)
            else:
                drawn = torch.multinomial(torch.softmax(logits / call.temperature, dim=-1), call.alt_k,
                                          replacement=True, generator=generator)
            scores.alt[0].extend(drawn.tolist())
            scores.alt[1].extend(logprobs.gather(1, drawn).tolist())
