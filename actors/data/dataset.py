"""A job's dataset read whole into labelled examples, from any location `locations.open_table` opens (JSON /
JSONL, parquet, arrow, a saved `datasets` folder, a folder of files), with a `split` and a column mapping
(`columns`: the format's field name -> the dataset's column name) applied to every row."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.data.formats import PreferenceFormat
from actors.data.locations import open_table
from actors.data.pairs import PreferencePair, pair_tokens, tokenize_pair
from actors.data.rows import DataError, _row_error
from actors.data.tables import Row, RowTable
from actors.data.tokenize import (
    Example,
    LoadedData,
    _adds_bos,
    _check_max_seq_len,
    _finish,
    _row_tokens,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def remap_columns(row: dict[str, Any], columns: Mapping[str, str] | None, source: str, line: int) -> dict[str, Any]:
    """`row` with each format field of `columns` set from its dataset column, or from a value nested in one: a
    dotted path (`answers.text.0`, `instances.0.output`: a key of an object, an index of a list) where the row has
    no column of that very name; a column or path the row lacks is a `DataError` naming the file, the row, the
    column and what the row has there."""
    if not columns:
        return row
    mapped = dict(row)
    for field, column in columns.items():
        if column in row:
            mapped[field] = row[column]
            continue
        found, value, why = _nested(row, column)
        if not found:
            raise _row_error(source, line, f"column '{column}' is missing (columns maps the format's field "
                                           f"'{field}' to it; {why})", field=column)
        mapped[field] = value
    return mapped


def _nested(row: dict[str, Any], path: str) -> tuple[bool, Any, str]:
    """The value at a dotted `path` in `row`: (True, value, ""), or (False, None, what the row has where the path
    leaves it)."""
    present = ", ".join(sorted(row)) or "none"
    parts = path.split(".")
    if len(parts) < 2 or parts[0] not in row:
        return False, None, f"the row's columns: {present}"
    value: Any = row[parts[0]]
    for depth, part in enumerate(parts[1:], start=1):
        reached = ".".join(parts[:depth])
        if isinstance(value, dict):
            if part not in value:
                keys = ", ".join(sorted(map(str, value))) or "none"
                return False, None, f"'{reached}' is an object without '{part}'; its keys: {keys}"
            value = value[part]
        elif isinstance(value, list):
            if not part.lstrip("-").isdigit() or not -len(value) <= int(part) < len(value):
                return False, None, f"'{reached}' is a list of {len(value)}: '{part}' is not an index of it"
            value = value[int(part)]
        else:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            return False, None, f"'{reached}' holds {shown}, not an object or a list"
    return True, value, ""


def check_encodable(value: Any, source: str, line: int, field: str | None = None) -> None:
    """Every text in the row (nested in lists and objects too) can be encoded as UTF-8, which the tokenizer needs:
    JSON may hold a lone surrogate (`"\\ud800"`), which Python reads but no tokenizer can encode; a `DataError`
    names the file, the row, the field and where in it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise _row_error(source, line, f"field '{field}' holds text the tokenizer cannot encode: {error.reason} "
                                           f"{value[error.start:error.end]!r} at character {error.start} (a lone "
                                           "UTF-16 surrogate, as a JSON \\ud800 escape writes one); fix the row or "
                                           "remove it", field=field) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_encodable(item, source, line, key if field is None else f"{field}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_encodable(item, source, line, f"{field}[{index}]")


class RowTokenizer:
    """One row (after the column mapping) into an `Example`, or None where truncation to `max_seq_len` leaves
    no target token; `prompt_lengths` keeps the shortest prompt of a dropped row for the error message."""

    def __init__(self, fmt: Any, tokenizer: PreTrainedTokenizerBase, *, max_seq_len: int,
                 train_on_prompt: bool = False, columns: Mapping[str, str] | None = None):
        _check_max_seq_len(max_seq_len)
        self.fmt, self.tokenizer = fmt, tokenizer
        self.max_seq_len, self.train_on_prompt = max_seq_len, train_on_prompt
        self.columns = dict(columns or {})
        self.add_bos = _adds_bos(tokenizer)
        self.shortest_dropped_prompt: int | None = None

    def __call__(self, item: Row) -> Example | PreferencePair | None:
        source, line, row = item
        row = remap_columns(row, self.columns, source, line)
        check_encodable(row, source, line)
        if isinstance(self.fmt, PreferenceFormat):   # dpo / orpo: a pair of sequences per row
            return self._pair(row, source, line)
        ids, labels, prompt_len = _row_tokens(row, self.fmt, self.tokenizer, train_on_prompt=self.train_on_prompt,
                                              add_bos=self.add_bos, source=source, line=line)
        example = _finish(ids, labels, self.max_seq_len)
        if example is None:
            shortest = self.shortest_dropped_prompt
            self.shortest_dropped_prompt = prompt_len if shortest is None else min(shortest, prompt_len)
        return example

    def _pair(self, row: dict[str, Any], source: str, line: int) -> PreferencePair | None:
        pair = tokenize_pair(row, self.fmt, self.tokenizer, max_seq_len=self.max_seq_len,
                             train_on_prompt=self.train_on_prompt, add_bos=self.add_bos, source=source, line=line)
        if pair is None:
            _, _, prompt_len = pair_tokens(row, self.fmt, self.tokenizer, add_bos=self.add_bos, source=source,
                                           line=line)
            shortest = self.shortest_dropped_prompt
            self.shortest_dropped_prompt = prompt_len if shortest is None else min(shortest, prompt_len)
        return pair

    def all_dropped(self, source: str, rows: int) -> DataError:
        needed = (self.shortest_dropped_prompt or 0) + 1
        return DataError(f"{source}: all {rows} rows were dropped: no target token is left after truncation to "
                         f"max_seq_len={self.max_seq_len}; raise max_seq_len (the shortest prompt needs at least "
                         f"{needed}) or set train_on_prompt", source=source)


def examples_from(rows: Iterator[Row], tokenize: RowTokenizer, source: str) -> LoadedData:
    """Tokenize every row; a `DataError` when there is none, or when every row is dropped."""
    examples: list[Example] = []
    total = 0
    for item in rows:
        total += 1
        example = tokenize(item)
        if example is not None:
            examples.append(example)
    if total == 0:
        raise DataError(f"{source}: the dataset holds no rows; add at least one", source=source)
    if not examples:
        raise tokenize.all_dropped(source, total)
    return LoadedData(examples=examples, dropped=total - len(examples), source=source)


def load_dataset_examples(
    data: str | Path,
    fmt: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    train_on_prompt: bool = False,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    table: RowTable | None = None,
) -> LoadedData:
    """Read and tokenize a whole dataset (`data`: see locations.py); like `load_examples` for a JSON file,
    which it reads the same way."""
    tokenize = RowTokenizer(fmt, tokenizer, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt,
                            columns=columns)
    table = table if table is not None else open_table(data, split)
    return examples_from(table.read_all(), tokenize, table.source)
