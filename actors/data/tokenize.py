"""Rows into labelled examples: token ids and unshifted labels, -100 where a token is not a training
target, per format, truncated to max_seq_len."""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actors.data.formats import (
    ALPACA_PROMPT_NO_INPUT,
    ALPACA_PROMPT_WITH_INPUT,
    AlpacaFormat,
    ChatFormat,
    PromptResponseFormat,
    TextFormat,
)
from actors.data.rows import DataError, _row_error, _type_name
from actors.data.sharegpt import is_sharegpt, sharegpt_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
"""Label value for tokens that are not training targets."""


# --------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    """One tokenized training sequence.

    Labels are *not* shifted: ``labels[t] == input_ids[t]`` where token ``t``
    is a training target and ``-100`` elsewhere.  Position 0 is never a target
    (nothing precedes it to predict it from).
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"input_ids and labels differ in length ({len(self.input_ids)} vs {len(self.labels)})"
            )

    @property
    def num_targets(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)

    @functools.cached_property
    def loss_targets(self) -> int:
        """Positions whose next token is a label (a step's loss targets; position 0 never is one), counted once."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class LoadedData:
    """Result of ``load_examples``."""

    examples: list[Example]
    dropped: int
    source: str


# --------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer normally prepends its BOS token."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a").input_ids
    return len(ids) > 0 and ids[0] == bos


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _string_field(row: dict[str, Any], name: str, source: str, line: int, uses: str, *, optional: bool = False) -> str:
    if name not in row:
        if optional:
            return ""
        present = ", ".join(sorted(row)) or "none"
        raise _row_error(
            source,
            line,
            f"field '{name}' is missing ({uses}; the row has: {present})",
            field=name,
        )
    value = row[name]
    if value is None and optional:
        return ""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):   # one way to write it: 72
        return str(int(value))
    if not isinstance(value, str):
        raise _row_error(
            source,
            line,
            f"field '{name}' must be a string, got {_type_name(value)} (a whole number is read as its digits; write "
            "other values as text: quoted in JSON, a string column in parquet)",
            field=name,
        )
    return value


def _prompt_response_texts(row: dict[str, Any], fmt: PromptResponseFormat, source: str, line: int) -> tuple[str, str]:
    ordered = fmt.ordered_fields()
    named = fmt.prompt.strip()
    if named in row and "{" not in fmt.prompt:   # `prompt: question`, meaning the field, not the word
        raise _row_error(source, line, f"the prompt template {fmt.prompt!r} names no row field, so every row's prompt "
                         f"would be that word, yet the row has a field '{named}': write '{{{named}}}' to use its value "
                         "(a template's fields are in braces)", field=named)
    uses = "format prompt_response uses " + ", ".join(f"{{{n}}}" for n in ordered)
    values = {name: _string_field(row, name, source, line, uses) for name in ordered}
    return fmt.prompt.format_map(values), fmt.response.format_map(values)


def _alpaca_texts(row: dict[str, Any], source: str, line: int) -> tuple[str, str]:
    uses = "format alpaca uses instruction, input (optional), output"
    instruction = _string_field(row, "instruction", source, line, uses)
    input_text = _string_field(row, "input", source, line, uses, optional=True)
    output = _string_field(row, "output", source, line, uses)
    if input_text.strip():
        prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    else:
        prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
    return prompt, output


def _chat_messages(row: dict[str, Any], fmt: ChatFormat, source: str, line: int) -> list[dict[str, Any]]:
    name = fmt.messages_field
    if name not in row:
        present = ", ".join(sorted(row)) or "none"
        raise _row_error(
            source,
            line,
            f"field '{name}' is missing (format chat reads messages from '{name}'; the row has: {present}; "
            "set messages_field to the right name)",
            field=name,
        )
    messages = row[name]
    if is_sharegpt(messages):   # ShareGPT {from, value} turns: actors/data/sharegpt.py
        messages = sharegpt_messages(messages, name, source, line)
    if not isinstance(messages, list) or not messages:
        raise _row_error(
            source,
            line,
            f"field '{name}' must be a non-empty list of {{\"role\", \"content\"}} objects, got {_type_name(messages)}",
            field=name,
        )
    for index, message in enumerate(messages):
        where = f"{name}[{index}]"
        if not isinstance(message, dict):
            raise _row_error(
                source,
                line,
                f"field '{where}' must be an object with 'role' and 'content', got {_type_name(message)}",
                field=where,
            )
        for key in ("role", "content"):
            if key not in message:
                raise _row_error(source, line, f"field '{where}.{key}' is missing", field=f"{where}.{key}")
            if not isinstance(message[key], str):
                raise _row_error(
                    source,
                    line,
                    f"field '{where}.{key}' must be a string, got {_type_name(message[key])}",
                    field=f"{where}.{key}",
                )
    if not any(m["role"] == "assistant" for m in messages):
        raise _row_error(
            source,
            line,
            f"field '{name}' has no 'assistant' message, so there is nothing to train on",
            field=name,
        )
    return messages


def _render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    source: str,
    line: int,
) -> str:
    # transformers raises ValueError without a chat template and a jinja2
    # TemplateError (not a ValueError) when the template rejects the messages.
    from jinja2.exceptions import TemplateError

    try:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (TemplateError, ValueError) as exc:
        raise _row_error(source, line, f"the tokenizer's chat template failed on this row: {exc}") from exc
    if not isinstance(rendered, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, expected str")
    return rendered


def _chat_ids(
    row: dict[str, Any],
    fmt: ChatFormat,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
    line: int,
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it
    belongs to an assistant turn (content plus what the template emits after
    it up to the next message).

    The spans are found by rendering prefixes: ``messages[:i]`` with a
    generation prompt marks where assistant turn ``i`` starts and
    ``messages[:i+1]`` where it ends.  The full text is tokenized once (as
    ``apply_chat_template(tokenize=True)`` does) and tokens are assigned by
    their character offsets; a token overlapping an assistant span is a target
    (the last assistant turn's only, with ``mask_history``).
    """
    messages = _chat_messages(row, fmt, source, line)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("format chat needs a fast tokenizer (character offsets); load it with use_fast=True")
    full = _render_chat(tokenizer, messages, False, source, line)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], True, source, line) if i else ""
        through = _render_chat(tokenizer, messages[: i + 1], False, source, line)
        if not full.startswith(before) or not full.startswith(through) or len(through) < len(before):
            raise _row_error(
                source,
                line,
                f"the chat template does not render message {i} (assistant) as a prefix of the whole "
                "conversation, so its tokens cannot be located; use format text or a different template",
                field=f"{fmt.messages_field}[{i}]",
            )
        spans.append((len(before), len(through)))
    if fmt.mask_history:
        spans = spans[-1:]
    encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    targets: list[bool] = []
    for start, end in offsets:
        if start == end:
            hit = any(a <= start < b for a, b in spans)
        else:
            hit = any(start < b and end > a for a, b in spans)
        targets.append(hit)
    return ids, targets


def _row_tokens(
    row: dict[str, Any],
    fmt: AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat,
    tokenizer: PreTrainedTokenizerBase,
    *,
    train_on_prompt: bool,
    add_bos: bool,
    source: str,
    line: int,
) -> tuple[list[int], list[int], int]:
    """Untruncated ``(input_ids, labels, prompt_length)`` for one row."""
    if isinstance(fmt, ChatFormat):
        ids, targets = _chat_ids(row, fmt, tokenizer, source, line)
        labels = [tok if (train_on_prompt or hit) else IGNORE_INDEX for tok, hit in zip(ids, targets, strict=True)]
        first_target = next((i for i, hit in enumerate(targets) if hit), len(ids))
        if labels:
            labels[0] = IGNORE_INDEX
        return ids, labels, first_target

    if isinstance(fmt, TextFormat):
        uses = f"format text reads '{fmt.field}'"
        prompt_text, response_text = "", _string_field(row, fmt.field, source, line, uses)
    elif isinstance(fmt, PromptResponseFormat):
        prompt_text, response_text = _prompt_response_texts(row, fmt, source, line)
    elif isinstance(fmt, AlpacaFormat):
        prompt_text, response_text = _alpaca_texts(row, source, line)
    else:
        raise TypeError(f"unknown data format {type(fmt).__name__}")

    prefix = [tokenizer.bos_token_id] if add_bos else []
    prompt_ids = prefix + _encode(tokenizer, prompt_text)
    response_ids = _encode(tokenizer, response_text)
    if tokenizer.eos_token_id is not None:
        response_ids.append(tokenizer.eos_token_id)
    ids = prompt_ids + response_ids
    if train_on_prompt:
        labels = list(prompt_ids) + list(response_ids)
    else:
        labels = [IGNORE_INDEX] * len(prompt_ids) + list(response_ids)
    if labels:
        labels[0] = IGNORE_INDEX
    return ids, labels, len(prompt_ids)


def _finish(ids: list[int], labels: list[int], max_seq_len: int) -> Example | None:
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    if all(label == IGNORE_INDEX for label in labels):
        return None
    return Example(tuple(ids), tuple(labels))


def _check_max_seq_len(max_seq_len: int) -> None:
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")


def tokenize_example(
    row: dict[str, Any],
    fmt: AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    train_on_prompt: bool = False,
    source: str = "<row>",
    line: int = 0,
) -> Example | None:
    """Tokenize one row into an ``Example``, or ``None`` when truncation to
    ``max_seq_len`` (keeping the start) leaves no target token.

    Prompt and response are tokenized separately (``add_special_tokens=False``)
    and concatenated, so the boundary is exact; BOS is prepended only if the
    tokenizer normally adds one and EOS is appended to the response as a
    target.  Chat rows go through the tokenizer's chat template instead.
    """
    _check_max_seq_len(max_seq_len)
    ids, labels, _ = _row_tokens(
        row,
        fmt,
        tokenizer,
        train_on_prompt=train_on_prompt,
        add_bos=_adds_bos(tokenizer),
        source=source,
        line=line,
    )
    return _finish(ids, labels, max_seq_len)


def tokenize_rows(
    rows: list[tuple[int, dict[str, Any]]],
    fmt: AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat,
    tokenizer: PreTrainedTokenizerBase,
    *,
    source: str,
    max_seq_len: int,
    train_on_prompt: bool = False,
) -> LoadedData:
    """Tokenize a dataset's (line, row) pairs into examples (`source` names the file in errors).

    Rows left without a target token by truncation are dropped and counted;
    no rows, or every row dropped, is a ``DataError``.
    """
    _check_max_seq_len(max_seq_len)
    if not rows:
        raise DataError(f"{source}: the file holds no rows; add at least one JSON object", source=source)
    add_bos = _adds_bos(tokenizer)
    examples: list[Example] = []
    dropped = 0
    shortest_prompt: int | None = None
    for line, row in rows:
        ids, labels, prompt_len = _row_tokens(
            row, fmt, tokenizer, train_on_prompt=train_on_prompt, add_bos=add_bos, source=source, line=line
        )
        example = _finish(ids, labels, max_seq_len)
        if example is None:
            dropped += 1
            shortest_prompt = prompt_len if shortest_prompt is None else min(shortest_prompt, prompt_len)
        else:
            examples.append(example)
    if not examples:
        needed = (shortest_prompt or 0) + 1
        raise DataError(
            f"{source}: all {len(rows)} rows were dropped: no target token is left after truncation "
            f"to max_seq_len={max_seq_len}; raise max_seq_len (the shortest prompt needs at least "
            f"{needed}) or set train_on_prompt",
            source=source,
        )
    return LoadedData(examples=examples, dropped=dropped, source=source)
