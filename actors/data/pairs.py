"""Preference data (`format: {type: preference}`) for DPO and ORPO jobs: each row a prompt and two
completions, the preferred (`chosen`) and the rejected one, tokenized into a `PreferencePair` of two
sequences (prompt + chosen, prompt + rejected) whose labels are the completion's tokens.

Text rows: the prompt and each completion are tokenized separately (`add_special_tokens=False`) and
concatenated, BOS first where the tokenizer adds one and EOS after the completion (as a target), the
boundary exact as in the SFT formats. Chat rows (the prompt a list of `{role, content}` messages; a
completion a list of assistant messages or one text, taken as one assistant message) go through the
tokenizer's chat template as TRL's DPOTrainer does: the completion starts where the tokens of the prompt
rendered with the generation prompt and those of the whole conversation diverge. A row without a prompt
(chosen and rejected each the whole conversation or text, as Anthropic's HH-RLHF), or with a text prompt beside
whole conversations (UltraFeedback's), has TRL's implicit prompt: what chosen and rejected share from the start.

Both sequences are cut to `max_seq_len` (keeping the start); a pair left without a target token in either
is dropped (and counted). Every problem with a row is a `DataError` naming the file, the line and the
field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actors.data.formats import PreferenceFormat
from actors.data.rows import DataError, _row_error, _type_name
from actors.data.tokenize import IGNORE_INDEX, Example, LoadedData, _adds_bos, _encode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class PreferencePair:
    """One preference example: two sequences sharing their first `prompt_length` tokens (the prompt).
    `len()` is both sequences' tokens (what the pair occupies in a packed step). The labels hold the
    completion's tokens, and for an ORPO job with `train_on_prompt` the chosen sequence's prompt too
    (its language-modelling term then covers the whole sequence, as TRL's ORPOTrainer's does)."""

    chosen: Example
    rejected: Example
    prompt_length: int

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    @property
    def rows(self) -> tuple[Example, Example]:
        return self.chosen, self.rejected

    @property
    def num_targets(self) -> int:
        return self.chosen.num_targets + self.rejected.num_targets


def example_rows(examples: list[Any]) -> list[Example]:
    """The sequences of a micro-batch in stream order: an `Example` is one, a `PreferencePair` two (chosen,
    then rejected), a GRPO `Rollout` (actors/engine/grpo.py) its completions."""
    rows: list[Example] = []
    for example in examples:
        if isinstance(example, Example):
            rows.append(example)
        else:
            rows.extend(example.rows)
    return rows


def _text_or_messages(row: dict[str, Any], name: str, source: str, line: int, *, completion: bool,
                      chat: bool | None) -> str | list[dict[str, str]]:
    """A row's prompt or completion: text, or (chat rows) a list of messages; a completion of a chat row may
    be one text (an assistant message)."""
    if name not in row:
        present = ", ".join(sorted(row)) or "none"
        raise _row_error(source, line, f"field '{name}' is missing (format preference reads prompt, chosen and "
                                       f"rejected; the row has: {present}; set prompt_field / chosen_field / "
                                       "rejected_field to the right names)", field=name)
    value = row[name]
    if isinstance(value, str):
        if chat and completion:
            return [{"role": "assistant", "content": value}]
        if chat:
            raise _row_error(source, line, f"field '{name}' must be a list of messages like the prompt", field=name)
        return value
    if not isinstance(value, list) or not value or (chat is False):
        expected = "a string" if chat is False else "a string or a non-empty list of {\"role\", \"content\"} objects"
        raise _row_error(source, line, f"field '{name}' must be {expected}, got {_type_name(value)}"
                                       + (" (the prompt is text, so the completions must be text)"
                                          if chat is False and isinstance(value, list) else ""), field=name)
    for index, message in enumerate(value):
        where = f"{name}[{index}]"
        if not isinstance(message, dict):
            raise _row_error(source, line, f"field '{where}' must be an object with 'role' and 'content', got "
                                           f"{_type_name(message)}", field=where)
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _row_error(source, line, f"field '{where}.{key}' must be a string, got "
                                               f"{_type_name(message.get(key))}", field=f"{where}.{key}")
        if completion and message["role"] != "assistant":
            raise _row_error(source, line, f"field '{where}.role' is '{message['role']}': a completion holds "
                                           "assistant messages only", field=f"{where}.role")
    return value


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], source: str, line: int,
              *, generation_prompt: bool) -> list[int]:
    from jinja2.exceptions import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError) as exc:
        raise _row_error(source, line, f"the tokenizer's chat template failed on this row: {exc}") from exc
    return list(encoded["input_ids"])


def _common_prefix(ids: Sequence[Any], other: Sequence[Any]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):   # the shorter one ends the common prefix
        if a != b:
            break
        length += 1
    return length


def _pair_fields(row: dict[str, Any], fmt: PreferenceFormat, source: str, line: int) -> tuple[Any, Any, Any]:
    """A row's (prompt, chosen, rejected): its own prompt, or the implicit one where it has none (or a text prompt
    beside whole conversations, as UltraFeedback's rows have)."""
    prompt = row.get(fmt.prompt_field)
    if fmt.prompt_field not in row or (isinstance(prompt, str) and isinstance(row.get(fmt.chosen_field), list)):
        return _implicit_prompt(row, fmt, source, line)
    prompt = _text_or_messages(row, fmt.prompt_field, source, line, completion=False, chat=None)
    chat = isinstance(prompt, list)
    return (prompt, _text_or_messages(row, fmt.chosen_field, source, line, completion=True, chat=chat),
            _text_or_messages(row, fmt.rejected_field, source, line, completion=True, chat=chat))


def _implicit_prompt(row: dict[str, Any], fmt: PreferenceFormat, source: str, line: int) -> tuple[Any, Any, Any]:
    """TRL's implicit prompt (`trl.extract_prompt`): chosen and rejected each hold the whole conversation or text,
    and the prompt is what they share from the start (whole messages; for text, characters, a space where they
    part left to the completions). Anthropic's HH-RLHF rows are of this kind."""
    chosen = _text_or_messages(row, fmt.chosen_field, source, line, completion=False, chat=None)
    rejected = _text_or_messages(row, fmt.rejected_field, source, line, completion=False, chat=None)
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise _row_error(source, line, f"fields '{fmt.chosen_field}' and '{fmt.rejected_field}' must both be text or "
                                       "both lists of messages", field=fmt.rejected_field)
    shared = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and shared and chosen[shared - 1] == " ":
        shared -= 1
    if not shared and fmt.prompt_field in row:   # a text prompt beside lists of messages
        raise _row_error(source, line, f"field '{fmt.prompt_field}' is text while '{fmt.chosen_field}' and "
                                       f"'{fmt.rejected_field}' are messages that share no turn to take as the prompt: "
                                       "give the prompt as messages [{\"role\": \"user\", \"content\": ...}] or the "
                                       "completions as text", field=fmt.prompt_field)
    if not shared:
        raise _row_error(source, line, f"field '{fmt.prompt_field}' is missing, and '{fmt.chosen_field}' and "
                                       f"'{fmt.rejected_field}' share no beginning to take as the prompt (the row has: "
                                       f"{', '.join(sorted(row))}); set prompt_field to the field holding the prompt",
                         field=fmt.prompt_field)
    if shared in (len(chosen), len(rejected)):
        raise _row_error(source, line, f"'{fmt.chosen_field}' and '{fmt.rejected_field}' are the same up to the end "
                                       "of one of them: no completion to compare", field=fmt.rejected_field)
    if isinstance(chosen, list):
        for name, messages in ((fmt.chosen_field, chosen), (fmt.rejected_field, rejected)):
            for index in range(shared, len(messages)):
                if messages[index]["role"] != "assistant":
                    raise _row_error(source, line, f"field '{name}[{index}].role' is '{messages[index]['role']}': "
                                                   "the prompt is the turns chosen and rejected share, and what "
                                                   "follows must be assistant messages", field=f"{name}[{index}].role")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def pair_tokens(row: dict[str, Any], fmt: PreferenceFormat, tokenizer: PreTrainedTokenizerBase, *,
                add_bos: bool, source: str, line: int) -> tuple[list[int], list[int], int]:
    """Untruncated (prompt + chosen ids, prompt + rejected ids, prompt length) of one row."""
    prompt, chosen, rejected = _pair_fields(row, fmt, source, line)
    chat = isinstance(prompt, list)
    if not chat:
        prompt_ids = ([tokenizer.bos_token_id] if add_bos else []) + _encode(tokenizer, prompt)
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        sequences = []
        for name, text in ((fmt.chosen_field, chosen), (fmt.rejected_field, rejected)):
            completion = _encode(tokenizer, text) + eos
            if not completion:
                raise _row_error(source, line, f"field '{name}' is empty and the tokenizer has no EOS token: "
                                               "nothing to compare", field=name)
            sequences.append(prompt_ids + completion)
        return sequences[0], sequences[1], len(prompt_ids)
    prompt_ids = _chat_ids(tokenizer, prompt, source, line, generation_prompt=True)
    chosen_ids = _chat_ids(tokenizer, prompt + chosen, source, line, generation_prompt=False)
    rejected_ids = _chat_ids(tokenizer, prompt + rejected, source, line, generation_prompt=False)
    prompt_length = min(_common_prefix(prompt_ids, chosen_ids), _common_prefix(prompt_ids, rejected_ids))
    return chosen_ids, rejected_ids, prompt_length


def _sequence(ids: list[int], prompt_length: int, max_seq_len: int, label_prompt: bool) -> Example | None:
    ids = ids[:max_seq_len]
    labels = [token if (label_prompt or index >= prompt_length) else IGNORE_INDEX for index, token in enumerate(ids)]
    if labels:
        labels[0] = IGNORE_INDEX
    if all(label == IGNORE_INDEX for label in labels[prompt_length:] or [IGNORE_INDEX]):
        return None   # no completion token left
    return Example(tuple(ids), tuple(labels))


def tokenize_pair(row: dict[str, Any], fmt: PreferenceFormat, tokenizer: PreTrainedTokenizerBase, *,
                  max_seq_len: int, train_on_prompt: bool = False, add_bos: bool | None = None,
                  source: str = "<row>", line: int = 0) -> PreferencePair | None:
    """One row into a `PreferencePair`, or None when truncation to `max_seq_len` leaves either completion
    without a token. `train_on_prompt` labels the chosen sequence's prompt too (ORPO's language-modelling
    term over the whole sequence)."""
    bos = _adds_bos(tokenizer) if add_bos is None else add_bos
    chosen_ids, rejected_ids, prompt_length = pair_tokens(row, fmt, tokenizer, add_bos=bos, source=source, line=line)
    chosen = _sequence(chosen_ids, prompt_length, max_seq_len, train_on_prompt)
    rejected = _sequence(rejected_ids, prompt_length, max_seq_len, False)
    if chosen is None or rejected is None:
        return None
    return PreferencePair(chosen, rejected, prompt_length)


def load_pairs(rows: list[tuple[int, dict[str, Any]]], fmt: PreferenceFormat, tokenizer: PreTrainedTokenizerBase,
               *, source: str, max_seq_len: int, train_on_prompt: bool = False) -> LoadedData:
    """A dataset's rows (`(line, row)` as `read_rows` gives them) into preference pairs; pairs left without a
    completion token by truncation are dropped and counted, and a dataset where all are is a `DataError`."""
    if not rows:
        raise DataError(f"{source}: the file holds no rows; add at least one JSON object", source=source)
    add_bos = _adds_bos(tokenizer)
    pairs: list[PreferencePair] = []
    dropped = 0
    shortest_prompt: int | None = None
    for line, row in rows:
        pair = tokenize_pair(row, fmt, tokenizer, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt,
                             add_bos=add_bos, source=source, line=line)
        if pair is None:
            dropped += 1
            _, _, prompt_length = pair_tokens(row, fmt, tokenizer, add_bos=add_bos, source=source, line=line)
            shortest_prompt = prompt_length if shortest_prompt is None else min(shortest_prompt, prompt_length)
        else:
            pairs.append(pair)
    if not pairs:
        raise DataError(f"{source}: all {len(rows)} preference rows were dropped: a completion has no token left "
                        f"after truncation to max_seq_len={max_seq_len}; raise max_seq_len (the shortest prompt "
                        f"needs at least {(shortest_prompt or 0) + 1})", source=source)
    return LoadedData(examples=pairs, dropped=dropped, source=source)  # type: ignore[arg-type]
