"""A dataset's rows as a `RowTable`, which hands them out lazily from any row on, so that a whole dataset is read
(`read_all`) or streamed a window at a time (streaming.py), and the kinds of table: a JSONL file, a parquet file
read one row group at a time, a memory-mapped Arrow table, and several files one after the other. locations.py
opens a dataset location as one of them.

Rows come as `(source, line, row)`: `source` names the file, `line` is a JSON file's 1-based line or a
table's 0-based `RowIndex` (errors show `file, row N`)."""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

from actors.data.rows import DataError, DataUnreadable, RowIndex, _json_error, _require_object, read_rows
from actors.storage.storage_errors import StorageError, StorageUnreachable
from actors.storage.storage_location import _explain
from actors.storage.storage_uri import is_uri

Row = tuple[str, int, dict[str, Any]]
"""`(source, line, row)`: the file, its 1-based line (JSON) or 0-based `RowIndex` (tables), the row."""

ARROW_CHUNK_ROWS = 1024
"""Rows converted to Python at a time from an Arrow table."""
JSONL_CHUNK_BYTES = 1 << 20
"""Bytes read at a time from a JSONL file."""


class RowTable(ABC):
    """A dataset's rows in a fixed order, read lazily."""

    source: str

    @abstractmethod
    def rows(self, start: int = 0) -> Iterator[Row]:
        """Rows from the 0-based row `start` on, read as they are needed (rows before `start` are skipped
        as cheaply as the format allows)."""

    def read_all(self) -> Iterator[Row]:
        """Every row (what a non-streaming job reads)."""
        return self.rows(0)

    def known_rows(self) -> int | None:
        """The number of rows where it is known without reading the data (file metadata), else None."""
        return None

    def count_rows(self) -> int:
        """The number of rows (read through the data where the metadata does not say)."""
        known = self.known_rows()
        return known if known is not None else sum(1 for _ in self.rows(0))

    def check_streamable(self) -> None:
        """Raise a `DataError` where the data cannot be read a part at a time (every table can, unless it
        says otherwise)."""
        return None

    def files(self) -> list[str]:
        """The files (paths or storage URIs) its rows are read from, in reading order (what digest.py hashes)."""
        return [self.source]


def _reading_error(source: str, doing: str, error: BaseException) -> Exception:
    """A failed read: a storage endpoint that did not answer stays `StorageUnreachable` (the job's start is
    tried again), anything else becomes a `DataError` naming the file and what was said."""
    if is_uri(source):
        explained = _explain(source, doing, error)
        if isinstance(explained, StorageUnreachable):
            return StorageUnreachable(f"the dataset {explained}")
        return DataUnreadable(f"the dataset {explained}", source=source, fix=explained.fix)
    return DataError(f"{source}: {doing} failed: {type(error).__name__}: {error}", source=source)


def data_chunks(source: str, opener: Callable[[], Any]) -> Iterator[bytes]:
    """A text data file's bytes, `JSONL_CHUNK_BYTES` at a time (local or under a storage URI); a file that is not
    there or cannot be read is a `DataError` naming it (an unreachable storage endpoint stays
    `StorageUnreachable`)."""
    try:
        stream = opener()
    except FileNotFoundError as error:
        raise DataUnreadable(f"{source}: file not found; check the dataset path", source=source) from error
    except OSError as error:
        raise _reading_error(source, "opening", error) from error
    with stream:
        while True:
            try:
                chunk = stream.read(JSONL_CHUNK_BYTES)
            except OSError as error:
                raise _reading_error(source, "reading", error) from error
            if not chunk:
                return
            yield chunk


class JsonlTable(RowTable):
    """A JSONL file (a JSON array file too, but only read whole), local or under a storage URI."""

    def __init__(self, source: str, opener: Callable[[], Any]):
        self.source = source
        self._open = opener

    def read_all(self) -> Iterator[Row]:
        return ((self.source, line, row) for line, row in read_rows(self.source))

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(1-based line number, bytes) of every line, read a chunk at a time."""
        number, pending = 0, b""
        for chunk in data_chunks(self.source, self._open):
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                number += 1
                yield number, raw
        if pending:
            yield number + 1, pending

    def check_streamable(self) -> None:
        for _number, raw in self._lines():
            if raw.strip():
                if _opens_array(raw):
                    raise DataError(f"{self.source}: a JSON array is read whole, so it cannot be streamed; write "
                                    "one object per line (JSONL) or parquet, or set streaming: false",
                                    source=self.source)
                return

    def rows(self, start: int = 0) -> Iterator[Row]:
        index, first = 0, True
        for number, raw in self._lines():
            if not raw.strip():
                continue
            if first and _opens_array(raw):   # a JSON array file: its rows as read whole (a remote one's first rows,
                yield from itertools.islice(self.read_all(), start, None)   # checked before start, were its first
                return                                                      # line taken as one row: "got list")
            first = False
            if index < start:   # skipped rows are not parsed
                index += 1
                continue
            index += 1
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{self.source}:{number}: not valid UTF-8 ({exc.reason}); re-save the file as "
                                "UTF-8", source=self.source, line=number) from exc
            if number == 1:
                text = text.removeprefix("\ufeff")
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _json_error(self.source, exc, line_offset=number - 1) from exc
            yield self.source, number, _require_object(self.source, number, value)

    def count_rows(self) -> int:
        """Its non-blank lines; a JSON array file's elements (as `rows` reads it: whole)."""
        count = 0
        for _number, raw in self._lines():
            if raw.strip():
                if count == 0 and _opens_array(raw):
                    return len(read_rows(self.source))
                count += 1
        return count


def _opens_array(line: bytes) -> bool:
    """Whether a file's first non-blank line opens a JSON array (a byte-order mark before it allowed)."""
    return line.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")


class ParquetTable(RowTable):
    """A parquet file, local or under a storage URI, read one row group at a time."""

    def __init__(self, source: str, opener: Callable[[], Any]):
        import pyarrow.parquet as pq

        self.source = source
        try:
            self.file = pq.ParquetFile(opener())
        except FileNotFoundError as error:
            raise DataUnreadable(f"{source}: file not found; check the dataset path", source=source) from error
        except StorageError:
            raise
        except OSError as error:
            if is_uri(source):
                raise _reading_error(source, "opening", error) from error
            raise DataError(f"{source}: not a readable parquet file: pyarrow says: {error}", source=source) from error
        except ValueError as error:   # pyarrow.ArrowInvalid: not parquet, or a damaged footer
            raise DataError(f"{source}: not a readable parquet file: pyarrow says: {error}", source=source) from error
        metadata = self.file.metadata
        self.group_rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]

    def known_rows(self) -> int:
        return sum(self.group_rows)

    def rows(self, start: int = 0) -> Iterator[Row]:
        first = 0
        for group, count in enumerate(self.group_rows):
            if first + count <= start:
                first += count
                continue
            try:
                rows = self.file.read_row_group(group).to_pylist()
            except (OSError, ValueError) as error:
                raise DataError(f"{self.source}: row group {group} (rows {first} to {first + count - 1}) is not "
                                f"readable: pyarrow says: {error}", source=self.source) from error
            for offset in range(max(start - first, 0), len(rows)):
                yield self.source, RowIndex(first + offset), rows[offset]
            first += count


class ArrowTable(RowTable):
    """A memory-mapped Arrow table (an `.arrow` file or a saved dataset's split), converted to Python rows a
    chunk at a time: its pages are read as they are touched, so it is never wholly in memory."""

    def __init__(self, source: str, num_rows: int, slicer: Callable[[int, int], Any], files: list[str]):
        self.source = source
        self.num_rows = num_rows
        self._slice = slicer   # (start, stop) -> pyarrow.Table of those rows
        self._files = files

    def known_rows(self) -> int:
        return self.num_rows

    def files(self) -> list[str]:
        return list(self._files)

    def rows(self, start: int = 0) -> Iterator[Row]:
        for first in range(start, self.num_rows, ARROW_CHUNK_ROWS):
            chunk = self._slice(first, min(first + ARROW_CHUNK_ROWS, self.num_rows)).to_pylist()
            for offset, row in enumerate(chunk):
                yield self.source, RowIndex(first + offset), row


class ConcatTable(RowTable):
    """Several files, one after the other (a folder's files in name order)."""

    def __init__(self, source: str, parts: list[RowTable]):
        self.source = source
        self.parts = parts

    def read_all(self) -> Iterator[Row]:
        for part in self.parts:
            yield from part.read_all()

    def known_rows(self) -> int | None:
        counts = [part.known_rows() for part in self.parts]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[misc]

    def count_rows(self) -> int:
        return sum(part.count_rows() for part in self.parts)

    def check_streamable(self) -> None:
        for part in self.parts:
            part.check_streamable()

    def files(self) -> list[str]:
        return [file for part in self.parts for file in part.files()]

    def rows(self, start: int = 0) -> Iterator[Row]:
        for part in self.parts:
            if start > 0:
                size = part.count_rows()
                if start >= size:
                    start -= size
                    continue
            yield from part.rows(start)
            start = 0
