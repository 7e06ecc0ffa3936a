"""Streaming a job's data (`streaming: true`): rows are read and tokenized a window at a time, never the whole
dataset, behind the same interface as `DataCursor` (next_batch / peek_lengths / state_dict / load_state_dict /
exhausted), so the job actor and the trainer handle both alike.

Order (deterministic, resumable): the training rows are cut into consecutive windows of `window` rows; each
window is read, tokenized and permuted with `random.Random(seed * 1_000_003 + epoch + w * 2**64)` (window w of
that epoch); the epoch visits the windows in order. With `window` >= the training rows there is one window
and its permutation is `DataCursor`'s for that epoch: a streaming job then sees exactly the batches of a
non-streaming one (when no row is dropped by truncation and there is no eval split). `shuffle_window: 0`
reads the rows in file order. Unlike `datasets`' buffer shuffle, no state but the position is needed to resume: a cursor
restored to a saved position re-reads that window and continues exactly where the saved one would have.

The position counts rows (not examples): rows whose tokens are all cut by `max_seq_len` are skipped.
Memory: the windows in use (at most `CACHED_WINDOWS`), each `window` rows and their examples, and the row
group (parquet) or chunk (arrow, JSONL) being read.

Evaluation: the first `eval_rows` rows of the data are the eval set (held in memory; a fraction is refused
by the spec, since the row count may be unknown and a fraction of data larger than memory may not fit), and
training streams the rows after them."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from actors.data.rows import DataError
from actors.data.tables import Row, RowTable
from actors.data.tokenize import Example

CACHED_WINDOWS = 3
"""Tokenized windows kept (the current one, the next one a peek reached, and one behind a re-fetch)."""
IN_ORDER_WINDOW = 1024
"""Rows read at a time when the rows are not shuffled."""

_END = object()


def window_seed(seed: int, epoch: int, window: int) -> int:
    """The seed of window `window`'s permutation in `epoch` (window 0's is `DataCursor`'s epoch seed)."""
    return seed * 1_000_003 + epoch + window * 2**64


class ShuffledWindows:
    """`table`'s rows `first_row` on (`num_rows` of them where known) as examples, `tokenize`d a window of
    `window` rows at a time and each window permuted with `seed` (see the module): `at(epoch, position)`."""

    def __init__(self, table: RowTable, tokenize: Callable[[Row], Example | None], seed: int, *, window: int,
                 shuffle: bool, first_row: int, num_rows: int | None):
        self.table, self.tokenize, self.seed = table, tokenize, seed
        self.window, self.shuffle = (window if shuffle else IN_ORDER_WINDOW), shuffle
        self.first_row, self.num_rows = first_row, num_rows
        self.rows_read = 0        # rows read from the table (a measure of the work done, for tests and logs)
        self.dropped = 0          # rows dropped by truncation, in the windows tokenized so far
        self.cached: OrderedDict[tuple[int, int, int], list[Example | None]] = OrderedDict()
        self.reader: tuple[int, Iterator[Row]] | None = None   # (the row it yields next, the iterator)

    def _read(self, start: int, count: int) -> list[Row]:
        if self.reader is not None and self.reader[0] == start:
            rows_iter = self.reader[1]
        else:
            rows_iter = self.table.rows(start)
        rows = list(islice(rows_iter, count))
        self.reader = (start + len(rows), rows_iter)
        self.rows_read += len(rows)
        return rows

    def examples(self, epoch: int, index: int) -> list[Example | None]:
        """Window `index` of `epoch`: its examples in their shuffled order (None for a dropped row)."""
        key = (self.seed, epoch, index) if self.shuffle else (self.seed, 0, index)
        cached = self.cached.get(key)
        if cached is not None:
            self.cached.move_to_end(key)
            return cached
        start = index * self.window
        count = self.window if self.num_rows is None else max(0, min(self.window, self.num_rows - start))
        rows = self._read(self.first_row + start, count) if count else []
        examples = [self.tokenize(row) for row in rows]
        self.dropped += sum(1 for e in examples if e is None)
        if self.shuffle:
            order = list(range(len(examples)))
            random.Random(window_seed(self.seed, epoch, index)).shuffle(order)
            examples = [examples[i] for i in order]
        self.cached[key] = examples
        while len(self.cached) > CACHED_WINDOWS:
            self.cached.popitem(last=False)
        return examples

    def at(self, epoch: int, position: int) -> Any:
        """The example (or None) at `position` of `epoch`, or `_END` past the epoch's last row."""
        if self.num_rows is not None and position >= self.num_rows:
            return _END
        index, offset = divmod(position, self.window)
        examples = self.examples(epoch, index)
        return examples[offset] if offset < len(examples) else _END


class StreamingCursor:
    """Micro-batches of `batch_size` examples from `table`'s rows `first_row` on, tokenized by `tokenize`
    (None for a row that is dropped), in windows of `window` rows shuffled with `seed` (see the module).

    With `epochs` set, `num_rows` (the training rows) must be given and the last batch may be short; without,
    the data repeats until the job's `max_steps` and batches wrap across epochs as `DataCursor`'s do."""

    def __init__(self, table: RowTable, tokenize: Callable[[Row], Example | None], batch_size: int, seed: int, *,
                 window: int, shuffle: bool = True, epochs: int | None = None, first_row: int = 0,
                 num_rows: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if epochs is not None and (epochs < 1 or num_rows is None):
            raise ValueError("epochs needs num_rows (the training rows) and must be >= 1")
        self.windows = ShuffledWindows(table, tokenize, seed, window=window, shuffle=shuffle, first_row=first_row,
                                       num_rows=num_rows)
        self.batch_size, self.epochs = batch_size, epochs
        self.epoch = 0
        self.position = 0
        self.examples_seen = 0

    @property
    def seed(self) -> int:
        return self.windows.seed

    @property
    def num_rows(self) -> int | None:
        return self.windows.num_rows

    # ------------------------------------------------------------------ the cursor

    @property
    def exhausted(self) -> bool:
        return (self.epochs is not None and self.epoch >= self.epochs - 1
                and self.windows.at(self.epoch, self.position) is _END)

    def _plan(self, count: int, epoch: int, position: int) -> tuple[list[Example], int, int]:
        batch: list[Example] = []
        empty_ends = 0   # epoch ends passed without an example in between: every row is dropped
        while len(batch) < count:
            item = self.windows.at(epoch, position)
            if item is _END:
                if position == 0:
                    source = self.windows.table.source
                    raise DataError(f"{source}: no rows to train on (the eval split takes them all, or "
                                    "the data is empty)", source=source)
                empty_ends += 1
                if empty_ends > 1:
                    source = self.windows.table.source
                    raise DataError(f"{source}: every row was dropped: no target token is left after "
                                    "truncation to max_seq_len; raise max_seq_len or set train_on_prompt",
                                    source=source)
                if self.epochs is not None and epoch + 1 >= self.epochs:
                    break
                epoch, position = epoch + 1, 0
                continue
            position += 1
            if item is not None:
                batch.append(item)
                empty_ends = 0
        # Normalise as DataCursor does: a finished epoch moves on to the next one unless it was the last.
        if (self.num_rows is not None and position >= self.num_rows
                and (self.epochs is None or epoch + 1 < self.epochs)):
            epoch, position = epoch + 1, 0
        return batch, epoch, position

    def next_batch(self) -> list[Example] | None:
        """The next micro-batch, or None once `epochs` are exhausted."""
        batch, self.epoch, self.position = self._plan(self.batch_size, self.epoch, self.position)
        if not batch:
            return None
        self.examples_seen += len(batch)
        return batch

    def peek_lengths(self, n_batches: int = 1) -> list[int]:
        """Token lengths of the examples of the next `n_batches` batches, without advancing."""
        if n_batches < 0:
            raise ValueError(f"n_batches must be >= 0, got {n_batches}")
        batch, _, _ = self._plan(self.batch_size * n_batches, self.epoch, self.position)
        return [len(example) for example in batch]

    def state_dict(self) -> dict[str, Any]:
        windows = self.windows
        # num_rows where counted: a checkpoint then says whether its data ran to its end (`raise_ends_at_once`)
        return {"epoch": self.epoch, "position": self.position, "examples_seen": self.examples_seen,
                "seed": windows.seed, "window": windows.window if windows.shuffle else 0,
                "first_row": windows.first_row, **({} if self.num_rows is None else {"num_rows": self.num_rows})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict`; later batches are then exactly those the saved cursor
        would have produced."""
        missing = [k for k in ("epoch", "position", "examples_seen", "seed") if k not in state]
        if missing:
            raise ValueError(f"cursor state is missing {', '.join(missing)}")
        windows = self.windows
        window = windows.window if windows.shuffle else 0
        for key, mine in (("window", window), ("first_row", windows.first_row)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"cursor state was saved with {key}={state[key]} but this stream has {key}={mine}; "
                                 "the position cannot be restored exactly (keep shuffle_window and eval_split)")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or (self.num_rows is not None and position > self.num_rows):
            raise ValueError(f"cursor state out of range: epoch={epoch}, position={position}")
        if self.epochs is not None and epoch >= self.epochs:
            raise ValueError(f"cursor state epoch {epoch} is beyond epochs={self.epochs}")
        windows.seed = int(state["seed"])
        self.epoch, self.position = epoch, position
        self.examples_seen = int(state["examples_seen"])


# ---------------------------------------------------------------------------------------------- a job's stream


class StreamedData:
    """A streaming job's data: its cursor over the training rows, its eval examples (the first `eval_rows`
    rows), the rows dropped among those, and the number of training rows where it is known (always with
    `epochs`: counted then, from file metadata where it has them or by one pass over the lines)."""

    def __init__(self, cursor: StreamingCursor, eval_examples: list[Example], eval_dropped: int,
                 train_rows: int | None):
        self.cursor, self.eval, self.eval_dropped, self.train_rows = cursor, eval_examples, eval_dropped, train_rows


def open_stream(data: Any, fmt: Any, tokenizer: Any, *, max_seq_len: int, train_on_prompt: bool = False,
                split: str = "train", columns: dict[str, str] | None = None, batch_size: int, seed: int,
                epochs: int | None, eval_rows: int = 0, shuffle_window: int = 1000,
                table: RowTable | None = None) -> StreamedData:
    """Open `data` (see locations.py) as a stream: only the eval rows are read now."""
    from actors.data.dataset import RowTokenizer
    from actors.data.locations import open_table

    table = table if table is not None else open_table(data, split)
    table.check_streamable()
    tokenize = RowTokenizer(fmt, tokenizer, max_seq_len=max_seq_len, train_on_prompt=train_on_prompt,
                            columns=columns)
    eval_examples: list[Example] = []
    eval_read = 0
    for row in islice(table.rows(0), eval_rows):
        eval_read += 1
        example = tokenize(row)
        if example is not None:
            eval_examples.append(example)
    if eval_read < eval_rows:
        raise DataError(f"{table.source}: eval_split={eval_rows} takes every one of its {eval_read} rows, leaving "
                        "none to train on; lower eval_split or add data", source=table.source)
    if eval_rows and not eval_examples:   # else the job would train without a single evaluation, and say nothing
        raise DataError(f"{table.source}: none of the eval split's {eval_rows} rows (the first) has a target token "
                        f"left after truncation to max_seq_len={max_seq_len}; raise max_seq_len or eval_split",
                        source=table.source, field="eval_split")
    total = table.count_rows() if epochs is not None else table.known_rows()
    train_rows = None if total is None else total - eval_rows
    if train_rows is not None and train_rows < 1:
        raise DataError(f"{table.source}: eval_split={eval_rows} takes all {total} rows, leaving none to train on; "
                        "lower eval_split or add data", source=table.source)
    cursor = StreamingCursor(table, tokenize, batch_size, seed, window=max(shuffle_window, 1),
                             shuffle=shuffle_window > 0, epochs=epochs, first_row=eval_rows, num_rows=train_rows)
    return StreamedData(cursor, eval_examples, eval_read - len(eval_examples), train_rows)
