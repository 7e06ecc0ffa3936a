"""A job's rows checked before anything starts: every row of a local file (the first rows of a remote or
streamed dataset) read and tokenized as its job will read them, so that a row that is not valid JSON, a template
naming a field the rows lack, text the tokenizer cannot encode, data whose every row truncates away, or an
`eval_split` that leaves no example to train on is refused while the jobs file is validated, with the same message
the job would have failed with minutes later."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from actors.data.batches import split_eval
from actors.data.dataset import RowTokenizer, examples_from
from actors.data.locations import open_table
from actors.data.rows import DataError
from actors.spec.job_spec import JobSpec
from actors.storage.storage_uri import is_uri

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REMOTE_SAMPLE_ROWS = 1000
"""Rows of a remote (storage URI) or streamed dataset checked before start: the rest are read as training goes."""


def check_job_rows(job: JobSpec, tokenizer: PreTrainedTokenizerBase, *,
                   sample_rows: int = REMOTE_SAMPLE_ROWS) -> tuple[int, bool]:
    """Read and tokenize the job's rows as its job actor will (the column mapping, the format, the tokenizer,
    max_seq_len): raises `DataError` naming the file, the row and the field. Returns (rows checked, whether that
    was all of them)."""
    table = open_table(job.data, job.split)
    if job.streaming:
        table.check_streamable()   # a JSON array, read whole, says so, not that its first line is no JSON row
    whole = not (job.streaming or is_uri(str(job.data)))
    rows = table.read_all() if whole else itertools.islice(table.rows(0), sample_rows)
    counted: list[int] = [0]

    def counting():
        for row in rows:
            counted[0] += 1
            yield row

    tokenize = _Recording(RowTokenizer(job.format, tokenizer, max_seq_len=job.max_seq_len,
                                       train_on_prompt=job.train_on_prompt, columns=job.columns))
    loaded = examples_from(counting(), tokenize, table.source)
    if whole:   # every example known: the evaluation split leaves some to train on (the job actor's own split)
        try:
            split_eval(loaded.examples, job.eval_split, seed=0)
        except DataError as error:
            dropped = (f" ({loaded.dropped} of {counted[0]} rows have no target token left after truncation to "
                       f"max_seq_len={job.max_seq_len})") if loaded.dropped else ""
            raise DataError(f"{table.source}: {error}{dropped}", source=table.source, field="eval_split") from None
    elif job.streaming and job.eval_split:   # a stream's eval split is its first rows
        _check_stream_split(job, table.source, counted[0], tokenize.kept, every_row=counted[0] < sample_rows)
    return counted[0], whole or counted[0] < sample_rows


class _Recording:
    """A RowTokenizer that also records, row by row, whether the row gave an example."""

    def __init__(self, tokenize: RowTokenizer):
        self.tokenize, self.kept = tokenize, []

    def __call__(self, row: tuple) -> object:
        example = self.tokenize(row)
        self.kept.append(example is not None)
        return example

    def all_dropped(self, source: str, total: int) -> DataError:
        return self.tokenize.all_dropped(source, total)


def _check_stream_split(job: JobSpec, source: str, read: int, kept: list[bool], *, every_row: bool) -> None:
    """A streaming job's `eval_split` (a count of first rows) against the rows read: none left to train on (where
    every row was read), or not one eval row with a target token; the job's own open_stream refuses both."""
    eval_rows = int(job.eval_split)
    if every_row and eval_rows >= read:
        raise DataError(f"{source}: eval_split={eval_rows} takes all {read} rows, leaving none to train on; lower "
                        "eval_split or add data", source=source, field="eval_split")
    if eval_rows <= read and not any(kept[:eval_rows]):
        raise DataError(f"{source}: none of the eval split's {eval_rows} rows (the first) has a target token left "
                        f"after truncation to max_seq_len={job.max_seq_len}; raise max_seq_len or eval_split",
                        source=source, field="eval_split")
