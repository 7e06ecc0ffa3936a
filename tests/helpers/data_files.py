"""Question-answer rows written as JSONL, CSV and parquet files, their reference examples, and a one-row change."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from actors.data import PromptResponseFormat, load_examples

QA = PromptResponseFormat(type="prompt_response", prompt="Q: {question}\nA:", response=" {answer}")


MAX_LEN = 64


def qa_rows(count: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"question": f"what is {i} plus {2 * i}?", "answer": f"{3 * i}", "id": i}
            for i in range(offset, offset + count)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict[str, Any]], delimiter: str = ",", encoding: str = "utf-8") -> Path:
    """The rows as Python's csv module writes them (a header row; fields quoted where they need it, lines ended
    by \\r\\n as spreadsheets end them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding=encoding) as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int = 7) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def reference(tmp_path: Path, rows: list[dict[str, Any]], tok: Any) -> list:
    return load_examples(write_jsonl(tmp_path / "reference.jsonl", rows), QA, tok, max_seq_len=MAX_LEN).examples


def change_one_row(path: Path, row: int = 3) -> None:
    """Another text in one row (its answer reversed): the row count and the file's size unchanged."""
    lines = path.read_text().splitlines()
    record = json.loads(lines[row])
    record["answer"] = record["answer"][::-1]
    lines[row] = json.dumps(record)
    path.write_text("\n".join(lines) + "\n")
