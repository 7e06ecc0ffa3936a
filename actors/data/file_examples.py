"""A whole dataset file (JSONL, or one JSON array) read into labelled examples: SFT rows through
`tokenize.py`, preference pairs (DPO / ORPO) through `pairs.py`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from actors.data.formats import (
    AlpacaFormat,
    ChatFormat,
    PreferenceFormat,
    PromptResponseFormat,
    TextFormat,
)
from actors.data.pairs import load_pairs
from actors.data.rows import read_rows
from actors.data.tokenize import LoadedData, _check_max_seq_len, tokenize_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_examples(
    path: str | Path,
    fmt: AlpacaFormat | PromptResponseFormat | ChatFormat | TextFormat | PreferenceFormat,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_seq_len: int,
    train_on_prompt: bool = False,
) -> LoadedData:
    """Read and tokenize a whole dataset file.

    Rows left without a target token by truncation are dropped and counted;
    an empty file or one where every row is dropped is a ``DataError``.
    """
    _check_max_seq_len(max_seq_len)   # before the file is read
    source = str(path)
    rows = read_rows(path)
    if isinstance(fmt, PreferenceFormat):   # DPO / ORPO: pairs of sequences
        return load_pairs(rows, fmt, tokenizer, source=source, max_seq_len=max_seq_len,
                          train_on_prompt=train_on_prompt)
    return tokenize_rows(rows, fmt, tokenizer, source=source, max_seq_len=max_seq_len,
                         train_on_prompt=train_on_prompt)
