"""A table's `count_rows` (actors/data/tables.py, csv_table.py) is the number of rows it reads: a JSON array file's
elements, not its lines (a streamed job's epoch length and a folder's rows read from a position count on it)."""

from __future__ import annotations

import csv
import json

import pytest

from actors.data.locations import open_table
from tests.helpers.data_files import qa_rows, write_csv, write_jsonl, write_parquet


def json_array(path, rows, indent):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=indent))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "array-one-line", "array-indented", "csv", "tsv", "parquet"])
def test_count_rows_is_the_number_of_rows_the_table_reads(kind, tmp_path):
    """Counted against the file's own reader (Python's json or csv module, the rows written): a JSON array on one
    line was counted 1 row, an indented one its number of lines (6 rows: 32 lines)."""
    rows = qa_rows(6)
    path = {"jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", rows),
            "array-one-line": lambda: json_array(tmp_path / "d.json", rows, None),
            "array-indented": lambda: json_array(tmp_path / "d.json", rows, 2),
            "csv": lambda: write_csv(tmp_path / "d.csv", rows),
            "tsv": lambda: write_csv(tmp_path / "d.tsv", rows, delimiter="\t"),
            "parquet": lambda: write_parquet(tmp_path / "d.parquet", rows, row_group_size=4)}[kind]()
    if kind == "jsonl":
        path.write_text(path.read_text().replace("\n", "\n\n", 2))   # blank lines, as the reader skips them
        expected = len([line for line in path.read_text().splitlines() if line.strip()])
    elif kind.startswith("array"):
        expected = len(json.loads(path.read_text()))
    elif kind in ("csv", "tsv"):
        with path.open(newline="") as handle:
            expected = len(list(csv.DictReader(handle, delimiter="\t" if kind == "tsv" else ",")))
    else:
        expected = len(rows)
    table = open_table(path)
    assert table.count_rows() == len(list(table.rows(0))) == expected == 6


def test_a_folder_of_json_array_files_is_read_from_a_position_as_from_its_start(tmp_path):
    """A folder's rows from row N skip whole files by their `count_rows`: with JSON array files counted by lines,
    rows from a position after the first file came from the wrong place (or none at all)."""
    json_array(tmp_path / "set" / "a.json", qa_rows(5), 2)
    json_array(tmp_path / "set" / "b.json", qa_rows(4, offset=5), None)
    table = open_table(tmp_path / "set")
    every = [row for _, _, row in table.rows(0)]
    assert every == qa_rows(9)
    for start in (3, 5, 7):
        assert [row for _, _, row in table.rows(start)] == every[start:], start
