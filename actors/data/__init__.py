"""Training data for aspen: dataset formats, file reading, tokenization into
labelled examples, train/eval splitting and a resumable batch cursor.

The job of this module is to turn a user's JSONL / JSON-array file into
``Example`` objects (token ids plus unshifted labels, ``-100`` on tokens that
are not training targets) and to hand them out in deterministic, resumable
micro-batches.  Every problem with the data is reported as a ``DataError``
whose message names the file, the 1-based line and the offending field.

Its parts: `rows` (reading files, `DataError`), `formats`, `tokenize` (rows into `Example`s),
`pairs` (preference pairs), `file_examples` (a whole file into examples),
`batches` (the evaluation split and the cursor)."""

from actors.data.batches import DataCursor, split_eval
from actors.data.file_examples import load_examples
from actors.data.formats import (
    AlpacaFormat,
    ChatFormat,
    DataFormat,
    PreferenceFormat,
    PromptResponseFormat,
    TextFormat,
)
from actors.data.rows import DataError, read_rows
from actors.data.tokenize import (
    IGNORE_INDEX,
    Example,
    LoadedData,
    tokenize_example,
)

__all__ = [
    "IGNORE_INDEX",
    "AlpacaFormat",
    "ChatFormat",
    "DataCursor",
    "DataError",
    "DataFormat",
    "Example",
    "LoadedData",
    "PreferenceFormat",
    "PromptResponseFormat",
    "TextFormat",
    "load_examples",
    "read_rows",
    "split_eval",
    "tokenize_example",
]
