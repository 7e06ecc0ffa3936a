"""Training data for aspen: dataset formats, file reading, tokenization into
labelled examples, train/eval splitting and a resumable batch cursor.

The job of this module is to turn a user's JSONL / JSON-array file into
``Example`` objects (token ids plus unshifted labels, ``-100`` on tokens that
are not training targets) and to hand them out in deterministic, resumable
micro-batches.  Every problem with the data is reported as a ``DataError``
whose message names the file, the 1-based line and the offending field.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "IGNORE_INDEX",
    "AlpacaFormat",
    "ChatFormat",
    "DataCursor",
    "DataError",
    "DataFormat",
    "Example",
    "LoadedData",
    "PromptResponseFormat",
    "TextFormat",
    "load_examples",
    "read_rows",
    "split_eval",
    "tokenize_example",
]

IGNORE_INDEX = -100
"""Label value for tokens that are not training targets."""


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class DataError(ValueError):
    """A problem with a dataset; the message names file, line and field.

    ``source``, ``line`` and ``field`` are also kept as attributes (``None``
    where they do not apply) for callers that want them programmatically.
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.source = source
        self.line = line
        self.field = field


def _row_error(source: str, line: int, message: str, field: str | None = None) -> DataError:
    return DataError(f"{source}:{line}: {message}", source=source, line=line, field=field)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return type(value).__name__


# --------------------------------------------------------------------------
# Dataset formats
# --------------------------------------------------------------------------

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


TEMPLATE_SPEC_LIMIT = 1000
"""Largest width or precision a template's format spec may ask for (``{x:>1000}``): a larger one would
build that many characters per row (``{x:>999999999}`` is a gigabyte string per row)."""

# Python's format spec mini-language: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(
    r"(?:(?P<fill>.)?(?P<align>[<>=^]))?(?P<sign>[-+ ])?z?#?0?(?P<width>\d+)?[,_]?"
    r"(?:\.(?P<precision>\d+))?(?P<type>[bcdeEfFgGnosxX%])?",
    re.DOTALL,
)


def _check_format_spec(template: str, name: str, spec: str, conversion: str | None) -> None:
    """Refuse what a field's conversion and format spec could do to every row: a conversion other than
    ``!s``/``!r``/``!a``, a nested field (``{x:{width}}``), a width or precision over
    ``TEMPLATE_SPEC_LIMIT``, or a spec that a text value cannot take (``{x:d}``)."""
    if conversion is not None and conversion not in ("s", "r", "a"):
        raise ValueError(
            f"template {template!r}, field '{name}': conversion '!{conversion}' is not one of !s, !r, !a"
        )
    if not spec:
        return
    if "{" in spec or "}" in spec:
        raise ValueError(
            f"template {template!r}, field '{name}': nested replacement fields in a format spec "
            f"('{{{name}:{spec}}}') are not supported; write the width or precision as a number "
            f"(at most {TEMPLATE_SPEC_LIMIT})"
        )
    match = _FORMAT_SPEC.fullmatch(spec)
    if match is None:
        raise ValueError(f"template {template!r}, field '{name}': format spec {spec!r} is not valid for a text value")
    for part in ("width", "precision"):
        digits = match.group(part)
        if digits is not None and int(digits) > TEMPLATE_SPEC_LIMIT:
            raise ValueError(
                f"template {template!r}, field '{name}': format spec {spec!r} has {part} {int(digits)}, over the "
                f"limit of {TEMPLATE_SPEC_LIMIT}"
            )
    try:
        format("text", spec)  # row values are strings: a spec they cannot take fails here, not per row
    except ValueError as exc:
        raise ValueError(
            f"template {template!r}, field '{name}': format spec {spec!r} is not valid for a text value: {exc}"
        ) from exc


def _template_fields(template: str) -> list[str]:
    """Field names used by a ``str.format`` template, in order, deduplicated.

    Raises ``ValueError`` for malformed templates, positional fields (``{}``,
    ``{0}``), attribute/index access (``{a.b}``, ``{a[0]}``), conversions other
    than ``!s``/``!r``/``!a``, nested fields in a format spec (``{a:{b}}``) and a
    width or precision over ``TEMPLATE_SPEC_LIMIT``.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"template {template!r} does not parse: {exc} (write literal braces as '{{{{' and '}}}}')"
        ) from exc
    names: list[str] = []
    for _literal, name, spec, conversion in parsed:
        if name is None:
            continue
        if name == "" or name.isdigit():
            raise ValueError(
                f"template {template!r} has a positional field '{{{name}}}'; "
                "name a row field instead, e.g. '{question}'"
            )
        if "." in name or "[" in name:
            raise ValueError(
                f"template {template!r} uses '{{{name}}}'; only plain row field names are "
                "supported (no attribute or index access)"
            )
        _check_format_spec(template, name, spec or "", conversion)
        if name not in names:
            names.append(name)
    return names


class AlpacaFormat(BaseModel):
    """Stanford Alpaca rows: ``instruction``, optional ``input``, ``output``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["alpaca"] = Field("alpaca", description="rows with instruction, optional input, output")

    def fields(self) -> set[str]:
        return {"instruction", "input", "output"}


class PromptResponseFormat(BaseModel):
    """Two ``str.format`` templates naming row fields, e.g.
    ``prompt="Question: {question}\\nAnswer:"``, ``response=" {answer}"``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["prompt_response"] = Field("prompt_response", description="two templates over the row's fields")
    prompt: str = Field(description="template of the prompt, e.g. `Question: {question}\\nAnswer:`")
    response: str = Field(description="template of the target, e.g. ` {answer}`")

    @field_validator("prompt", "response")
    @classmethod
    def _check_template(cls, value: str) -> str:
        _template_fields(value)
        return value

    def ordered_fields(self) -> list[str]:
        """Field names in order of first use (prompt first, then response)."""
        names = _template_fields(self.prompt)
        names += [n for n in _template_fields(self.response) if n not in names]
        return names

    def fields(self) -> set[str]:
        return set(self.ordered_fields())


class ChatFormat(BaseModel):
    """Rows holding a list of ``{role, content}`` messages, rendered through the
    tokenizer's chat template; the assistant turns are the targets."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["chat"] = Field("chat", description="messages through the tokenizer's chat template")
    messages_field: str = Field("messages", description="the row field holding the messages")

    def fields(self) -> set[str]:
        return {self.messages_field}


class TextFormat(BaseModel):
    """Plain text in one field; every token is a target."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = Field("text", description="plain text; every token is a target")
    field: str = Field("text", description="the row field holding the text")

    def fields(self) -> set[str]:
        return {self.field}


DataFormat = Annotated[
    Union[AlpacaFormat, PromptResponseFormat, ChatFormat, TextFormat],
    Field(discriminator="type"),
]


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

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class LoadedData:
    """Result of ``load_examples``."""

    examples: list[Example]
    dropped: int
    source: str


# --------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------


def _decode_utf8(raw: bytes, source: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{source}:{line}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
            "re-save the file as UTF-8",
            source=source,
            line=line,
        ) from exc
    return text.removeprefix("\ufeff")


def _json_error(source: str, exc: json.JSONDecodeError, line_offset: int = 0) -> DataError:
    line = exc.lineno + line_offset
    return DataError(
        f"{source}:{line}: invalid JSON: {exc.msg} (column {exc.colno})",
        source=source,
        line=line,
    )


def _require_object(source: str, line: int, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _row_error(
            source,
            line,
            f"each row must be a JSON object ({{...}}), got {_type_name(value)}",
        )
    return value


def _read_jsonl(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    rows: list[tuple[int, dict[str, Any]]] = []
    for index, line_text in enumerate(text.split("\n")):
        line = index + 1
        if not line_text.strip():
            continue
        try:
            value = json.loads(line_text)
        except json.JSONDecodeError as exc:
            raise _json_error(source, exc, line_offset=index) from exc
        rows.append((line, _require_object(source, line, value)))
    return rows


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_json_array(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    decoder = json.JSONDecoder()
    rows: list[tuple[int, dict[str, Any]]] = []
    # Line numbers are computed incrementally: `line` is the line of `counted`.
    counted, line = 0, 1

    def line_at(pos: int) -> int:
        nonlocal counted, line
        line += text.count("\n", counted, pos)
        counted = pos
        return line

    def fail(pos: int, message: str) -> DataError:
        at = line_at(pos)
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        return DataError(f"{source}:{at}: invalid JSON: {message} (column {column})", source=source, line=at)

    pos = _skip_ws(text, 0)
    # The caller checked that text[pos] == "[".
    pos = _skip_ws(text, pos + 1)
    if pos < len(text) and text[pos] == "]":
        pos += 1
    else:
        while True:
            if pos >= len(text):
                raise fail(pos, "unterminated array, expected ']'")
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise _json_error(source, exc) from exc
            start_line = line_at(pos)
            rows.append((start_line, _require_object(source, start_line, value)))
            pos = _skip_ws(text, end)
            if pos >= len(text):
                raise fail(pos, "unterminated array, expected ',' or ']'")
            if text[pos] == "]":
                pos += 1
                break
            if text[pos] != ",":
                raise fail(pos, "expected ',' or ']' after array element")
            pos = _skip_ws(text, pos + 1)
            if pos < len(text) and text[pos] == "]":
                raise fail(pos, "trailing comma before ']'")
    pos = _skip_ws(text, pos)
    if pos != len(text):
        raise fail(pos, "extra data after the closing ']'")
    return rows


def read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Read a JSONL file (one object per line, blank lines skipped) or a file
    holding one JSON array of objects; return ``(line_number, row)`` pairs with
    1-based line numbers (for arrays, the line each element starts on)."""
    source = str(path)
    file = Path(path)
    if not file.exists():
        raise DataError(f"{source}: file not found; check the dataset path", source=source)
    if not file.is_file():
        raise DataError(
            f"{source}: not a regular file; point the dataset path at a .jsonl or .json file",
            source=source,
        )
    text = _decode_utf8(file.read_bytes(), source)
    first = _skip_ws(text, 0)
    if first < len(text) and text[first] == "[":
        return _read_json_array(text, source)
    return _read_jsonl(text, source)


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
    if not isinstance(value, str):
        raise _row_error(
            source,
            line,
            f"field '{name}' must be a string, got {_type_name(value)} (quote it in the data file)",
            field=name,
        )
    return value


def _prompt_response_texts(row: dict[str, Any], fmt: PromptResponseFormat, source: str, line: int) -> tuple[str, str]:
    ordered = fmt.ordered_fields()
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
    their character offsets; a token overlapping an assistant span is a target.
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
        labels = [tok if (train_on_prompt or hit) else IGNORE_INDEX for tok, hit in zip(ids, targets)]
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


def load_examples(
    path: str | Path,
    fmt: AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    train_on_prompt: bool = False,
) -> LoadedData:
    """Read and tokenize a whole dataset file.

    Rows left without a target token by truncation are dropped and counted;
    an empty file or one where every row is dropped is a ``DataError``.
    """
    _check_max_seq_len(max_seq_len)
    source = str(path)
    rows = read_rows(path)
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


# --------------------------------------------------------------------------
# Train / eval split
# --------------------------------------------------------------------------


def split_eval(
    examples: list[Example], eval_split: float | int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Seeded, deterministic split into ``(train, eval)``.

    ``eval_split`` < 1 is a fraction (a positive fraction gives at least one
    eval example), >= 1 a count, 0 an empty eval set.  Both lists keep the
    original order.  At least one train example must remain.
    """
    if isinstance(eval_split, bool) or not isinstance(eval_split, (int, float)):
        raise TypeError(f"eval_split must be a number, got {type(eval_split).__name__}")
    if eval_split < 0:
        raise ValueError(f"eval_split must be >= 0, got {eval_split}")
    total = len(examples)
    if eval_split == 0:
        n_eval = 0
    elif eval_split < 1:
        n_eval = max(1, round(eval_split * total))
    else:
        if float(eval_split) != int(eval_split):
            raise ValueError(f"eval_split >= 1 is a count and must be a whole number, got {eval_split}")
        n_eval = int(eval_split)
    if total - n_eval < 1:
        raise DataError(
            f"eval_split={eval_split} takes {n_eval} of {total} examples, leaving none to train on; "
            "lower eval_split or add data"
        )
    order = list(range(total))
    random.Random(seed).shuffle(order)
    eval_indices = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in eval_indices]
    evaluation = [ex for i, ex in enumerate(examples) if i in eval_indices]
    return train, evaluation


# --------------------------------------------------------------------------
# Batch cursor
# --------------------------------------------------------------------------


class DataCursor:
    """Deterministic, resumable iteration over micro-batches of examples.

    Each epoch visits the examples in a fresh permutation seeded by
    ``(seed, epoch)``.  Batches wrap across epoch boundaries so every batch is
    full; with ``epochs`` set, the final batch may be shorter and
    ``next_batch`` then returns ``None``.

    ``epoch`` is the (0-based) epoch the next example comes from and
    ``position`` its index within that epoch's permutation; after the last
    epoch is finished, ``position == len(examples)`` and ``exhausted`` is true.
    """

    def __init__(self, examples: list[Example], batch_size: int, seed: int, epochs: int | None = None) -> None:
        if not examples:
            raise DataError("no examples to iterate over")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.epochs = epochs
        self.epoch = 0
        self.position = 0
        self.examples_seen = 0
        self._perm_cache: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Number of examples per epoch."""
        return len(self.examples)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs - 1 and self.position >= len(self.examples)

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        self._perm_cache = (epoch, order)
        return order

    def _plan(self, count: int, epoch: int, position: int) -> tuple[list[int], int, int]:
        """Indices of the next ``count`` examples from ``(epoch, position)``
        and the state after them, without touching ``self``'s position."""
        n = len(self.examples)
        indices: list[int] = []
        while len(indices) < count:
            if position >= n:
                if self.epochs is not None and epoch + 1 >= self.epochs:
                    break
                epoch, position = epoch + 1, 0
            take = min(count - len(indices), n - position)
            indices.extend(self._permutation(epoch)[position : position + take])
            position += take
        # Normalise: a finished epoch moves on to the next one unless it was the last.
        if position >= n and (self.epochs is None or epoch + 1 < self.epochs):
            epoch, position = epoch + 1, 0
        return indices, epoch, position

    def next_batch(self) -> list[Example] | None:
        """The next micro-batch, or ``None`` once ``epochs`` are exhausted."""
        indices, self.epoch, self.position = self._plan(self.batch_size, self.epoch, self.position)
        if not indices:
            return None
        self.examples_seen += len(indices)
        return [self.examples[i] for i in indices]

    def peek_lengths(self, n_batches: int = 1) -> list[int]:
        """Token lengths of the examples in the next ``n_batches`` batches (in
        order, flattened), without advancing."""
        if n_batches < 0:
            raise ValueError(f"n_batches must be >= 0, got {n_batches}")
        indices, _, _ = self._plan(self.batch_size * n_batches, self.epoch, self.position)
        return [len(self.examples[i]) for i in indices]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "examples_seen": self.examples_seen,
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by ``state_dict``; later batches are then
        exactly those the saved cursor would have produced."""
        missing = [k for k in ("epoch", "position", "examples_seen", "seed") if k not in state]
        if missing:
            raise ValueError(f"cursor state is missing {', '.join(missing)}")
        n = len(self.examples)
        saved_n = state.get("num_examples", n)
        if saved_n != n:
            raise ValueError(
                f"cursor state was saved for {saved_n} examples but this cursor has {n}; "
                "the dataset changed, so the position cannot be restored exactly"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= n:
            raise ValueError(f"cursor state out of range: epoch={epoch}, position={position} (examples: {n})")
        if self.epochs is not None and epoch >= self.epochs:
            raise ValueError(f"cursor state epoch {epoch} is beyond epochs={self.epochs}")
        self.seed = int(state["seed"])
        self.epoch = epoch
        self.position = position
        self.examples_seen = int(state["examples_seen"])
        self._perm_cache = None
