"""Reading a dataset file (JSONL, or one JSON array) into rows, and `DataError`, whose message names
the file, the 1-based line and the field of every problem. The file may be a path or a storage URI
(s3://bucket/train.jsonl, gs://..., file:///...: actors/storage/storage_location.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actors.storage.storage_errors import StorageError, StorageUnreachable
from actors.storage.storage_location import read_uri_bytes
from actors.storage.storage_uri import is_uri

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


class DataUnreadable(DataError):
    """A dataset that could not be found or read at all (no such file or object, no bucket, no or refused
    credentials): nothing is wrong with its rows. `fix`: what to fix instead, in a few words ("the URI", "the storage
    credentials"); its job's `data` field is where the file names it."""

    def __init__(self, message: str, *, source: str | None = None, fix: str | None = None) -> None:
        super().__init__(message, source=source, field="data")
        self.fix = fix or "the data path"


class RowIndex(int):
    """The 0-based index of a row in a table (parquet, arrow, a saved dataset), where a JSON file has a
    line number: errors show it as `file, row N` instead of `file:N`."""


def _row_error(source: str, line: int, message: str, field: str | None = None) -> DataError:
    where = f"{source}, row {line}" if isinstance(line, RowIndex) else f"{source}:{line}"
    return DataError(f"{where}: {message}", source=source, line=line, field=field)


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return type(value).__name__


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
    1-based line numbers (for arrays, the line each element starts on). `path` may be a storage URI."""
    source = str(path)
    if is_uri(source):
        try:
            raw = read_uri_bytes(source)
        except StorageUnreachable as error:   # not the data's fault: the job's start is tried again
            raise StorageUnreachable(f"the dataset {error}") from error
        except StorageError as error:
            raise DataUnreadable(f"the dataset {error}", source=source, fix=error.fix) from error
        return _parse(_decode_utf8(raw, source), source)
    file = Path(path)
    if not file.exists():
        raise DataUnreadable(f"{source}: file not found; check the dataset path", source=source)
    if not file.is_file():
        raise DataError(
            f"{source}: not a regular file; point the dataset path at a .jsonl or .json file",
            source=source,
        )
    return _parse(_decode_utf8(file.read_bytes(), source), source)


def _parse(text: str, source: str) -> list[tuple[int, dict[str, Any]]]:
    first = _skip_ws(text, 0)
    if first < len(text) and text[first] == "[":
        return _read_json_array(text, source)
    return _read_jsonl(text, source)
