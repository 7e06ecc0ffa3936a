"""A CSV or TSV file as a `RowTable` (tables.py): its first record is the header, which names the columns; every
later record is a row of strings, keyed by those names. Fields are quoted as spreadsheets and Python's `csv`
module write them (a quoted field may hold the delimiter, quotes doubled, or line breaks). Read a chunk at a time,
local or under a storage URI, so a large file streams. A row carries the physical line its record starts on
(1-based, the header's is 1), so that an error points where an editor shows the record."""

from __future__ import annotations

import codecs
import csv
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from actors.data.rows import DataError
from actors.data.tables import Row, RowTable, data_chunks

DELIMITERS = {".csv": ",", ".tsv": "\t"}


class CsvTable(RowTable):
    """A `.csv` (comma) or `.tsv` (tab) file with a header row."""

    def __init__(self, source: str, opener: Callable[[], Any], delimiter: str = ","):
        self.source = source
        self._open = opener
        self.delimiter = delimiter

    def _lines(self) -> Iterator[str]:
        """The file's text, a line at a time with its line break (what `csv.reader` needs to keep a quoted
        field's line breaks), decoded as UTF-8 (a byte-order mark dropped), read a chunk at a time."""
        decoder = codecs.getincrementaldecoder("utf-8-sig")()
        line, pending = 1, ""
        for chunk in itertools.chain(data_chunks(self.source, self._open), [b""]):   # b"": the decoder's end
            try:
                text = pending + decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                at = line + error.object[:error.start].count(b"\n")
                raise DataError(f"{self.source}:{at}: not valid UTF-8 ({error.reason}); re-save the file as UTF-8",
                                source=self.source, line=at) from error
            *complete, pending = text.split("\n")
            for piece in complete:
                yield piece + "\n"
                line += 1
        if pending:
            yield pending

    def _records(self) -> Iterator[tuple[int, list[str]]]:
        """(the line a record starts on, its fields) of every record, blank lines skipped."""
        reader = csv.reader(self._lines(), delimiter=self.delimiter, strict=True)
        start = 1
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                raise DataError(f"{self.source}:{start}: not a readable {self._kind} record: {error}; quote a field "
                                "that holds the delimiter, a quote or a line break (\"...\", quotes inside doubled)",
                                source=self.source, line=start) from error
            if fields:
                yield start, fields
            start = reader.line_num + 1

    @property
    def _kind(self) -> str:
        return "TSV" if self.delimiter == "\t" else "CSV"

    def _header(self, records: Iterator[tuple[int, list[str]]]) -> list[str] | None:
        """The column names (None for a file without any record)."""
        first = next(records, None)
        if first is None:
            return None
        line, names = first
        names = [name.strip() for name in names]
        if any(not name for name in names):
            raise DataError(f"{self.source}:{line}: the header row has an empty column name (column "
                            f"{names.index('') + 1}); the first row of a {self._kind} file names every column",
                            source=self.source, line=line)
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise DataError(f"{self.source}:{line}: the header row names {', '.join(map(repr, repeated))} more than "
                            "once; give each column its own name", source=self.source, line=line)
        return names

    def rows(self, start: int = 0) -> Iterator[Row]:
        records = self._records()
        names = self._header(records)
        if names is None:
            return
        index = 0
        for line, fields in records:
            if index < start:   # skipped records are not checked
                index += 1
                continue
            index += 1
            if len(fields) != len(names):
                raise DataError(f"{self.source}:{line}: {len(fields)} fields where the header names {len(names)} "
                                f"columns; quote a field that holds the delimiter ({self.delimiter!r})",
                                source=self.source, line=line)
            yield self.source, line, dict(zip(names, fields, strict=True))

    def count_rows(self) -> int:
        return max(sum(1 for _ in self._records()) - 1, 0)
