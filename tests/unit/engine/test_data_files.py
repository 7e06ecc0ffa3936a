"""actors.data reading files: JSONL and JSON-array rows with the line each starts on, each bad file or row refused
naming its file, line and field (DataError), rows too long dropped and an empty file refused; and the real GSM8K
and Code Alpaca files under shared/data, tokenized with SmolLM2's real tokenizer, give their text back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actors.data import AlpacaFormat, DataError, LoadedData, load_examples, read_rows, tokenize_example
from tests.helpers.data_formats import GSM8K, targets

SHARED_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- reading files and errors


def test_read_rows_jsonl_and_array(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"x": 1}\n\n  \n{"x": 2}\n')
    assert read_rows(jsonl) == [(1, {"x": 1}), (4, {"x": 2})]
    array = tmp_path / "b.json"
    array.write_text('\n[\n  {"x": 1},\n\n  {\n    "x": 2\n  }, {"x": 3}\n]\n')
    assert read_rows(array) == [(3, {"x": 1}), (5, {"x": 2}), (7, {"x": 3})]
    empty_array = tmp_path / "c.json"
    empty_array.write_text(" [ ] ")
    assert read_rows(empty_array) == []


def test_json_array_error_lines(tmp_path: Path, tok: Any) -> None:
    rows = [{"instruction": f"do {i}", "input": "", "output": f"done {i}"} for i in range(4)]
    rows[2]["output"] = 7.5
    path = tmp_path / "alp.json"
    path.write_text(json.dumps(rows, indent=2))
    # The third element starts on line 12: "[" + 5 lines per element.
    assert [line for line, _ in read_rows(path)] == [2, 7, 12, 17]
    with pytest.raises(DataError, match=rf"^{path}:12: field 'output' must be a string, got float"):
        load_examples(path, AlpacaFormat(type="alpaca"), tok, max_seq_len=64)
    rows[2]["output"] = 7   # a whole number: read as its digits, as "7" would be
    path.write_text(json.dumps(rows, indent=2))
    as_text = tmp_path / "text.json"
    as_text.write_text(json.dumps([{**row, "output": str(row["output"])} for row in rows], indent=2))
    assert load_examples(path, AlpacaFormat(type="alpaca"), tok, max_seq_len=64).examples == \
        load_examples(as_text, AlpacaFormat(type="alpaca"), tok, max_seq_len=64).examples

    bad = tmp_path / "bad.json"
    bad.write_text('[\n  {"a": "1"},\n  {"a": "2"\n   "b": 3}\n]\n')
    with pytest.raises(DataError, match=rf"^{bad}:4: invalid JSON: Expecting ',' delimiter \(column 4\)") as info:
        read_rows(bad)
    assert info.value.line == 4 and info.value.source == str(bad)

    not_object = tmp_path / "no.json"
    not_object.write_text('[\n  {"a": "1"},\n  [1, 2]\n]')
    with pytest.raises(DataError, match=rf"^{not_object}:3: each row must be a JSON object"):
        read_rows(not_object)

    trailing = tmp_path / "trailing.json"
    trailing.write_text('[\n  {"a": "1"},\n]')
    with pytest.raises(DataError, match=rf"^{trailing}:3: invalid JSON: trailing comma"):
        read_rows(trailing)


def test_jsonl_errors(tmp_path: Path, tok: Any) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n\n{"question": "c" "answer": "d"}\n')
    with pytest.raises(DataError, match=rf"^{path}:3: invalid JSON: Expecting ',' delimiter \(column 18\)"):
        read_rows(path)

    write_jsonl(path, [{"question": "a", "answer": "b"}, {"question": "c", "solution": "d"}])
    with pytest.raises(DataError) as info:
        load_examples(path, GSM8K, tok, max_seq_len=64)
    message = str(info.value)
    expected = f"{path}:2: field 'answer' is missing (format prompt_response uses {{question}}, {{answer}}"
    assert message.startswith(expected)
    assert "solution" in message  # hint: the fields the row does have
    assert info.value.field == "answer" and info.value.line == 2

    for value, kind in ((5.0, "float"), (True, "bool"), ([5], "list")):   # a truth value is no whole number here
        write_jsonl(path, [{"question": "a", "answer": value}])
        with pytest.raises(DataError, match=rf"^{path}:1: field 'answer' must be a string, got {kind}"):
            load_examples(path, GSM8K, tok, max_seq_len=64)

    write_jsonl(path, [{"question": "a", "answer": "b"}, "just a string"])
    with pytest.raises(DataError, match=rf"^{path}:2: each row must be a JSON object"):
        read_rows(path)

    with pytest.raises(DataError, match=r"missing\.jsonl: file not found"):
        load_examples(tmp_path / "missing.jsonl", GSM8K, tok, max_seq_len=64)

    path.write_bytes(b'{"question": "a", "answer": "b"}\n{"question": "\xff", "answer": "b"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8"):
        read_rows(path)


def test_load_examples_drops_and_empty(tmp_path: Path, tok: Any) -> None:
    long_q = "word " * 40
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "short?", "answer": "yes"},
        {"question": long_q, "answer": "no"},
        {"question": "also short?", "answer": "sure"},
    ])
    loaded = load_examples(path, GSM8K, tok, max_seq_len=20)
    assert isinstance(loaded, LoadedData)
    assert loaded.dropped == 1 and len(loaded.examples) == 2 and loaded.source == str(path)
    assert all(len(ex) <= 20 and ex.num_targets > 0 for ex in loaded.examples)

    with pytest.raises(DataError, match="raise max_seq_len"):
        load_examples(path, GSM8K, tok, max_seq_len=3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: .*no rows"):
        load_examples(empty, GSM8K, tok, max_seq_len=64)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared data folder absent")
def test_real_files(tok: Any) -> None:
    gsm_rows = read_rows(SHARED_DATA / "gsm8k_train.jsonl")[:200]
    assert [line for line, _ in gsm_rows] == list(range(1, 201))
    for line, row in gsm_rows:
        ex = tokenize_example(row, GSM8K, tok, max_seq_len=1024, train_on_prompt=False, source="gsm", line=line)
        assert ex is not None
        assert tok.decode(targets(ex)) == " " + row["answer"] + tok.eos_token
        assert tok.decode(list(ex.input_ids)) == f"Question: {row['question']}\nAnswer: {row['answer']}" + tok.eos_token

    alpaca_path = SHARED_DATA / "code_alpaca_2k.json"
    alpaca_rows = read_rows(alpaca_path)
    assert len(alpaca_rows) == 2017
    lines = alpaca_path.read_text().split("\n")
    for line, row in alpaca_rows[:200]:
        assert lines[line - 1].strip() == "{"  # the element really starts on that line
        ex = tokenize_example(row, AlpacaFormat(type="alpaca"), tok, max_seq_len=1024,
                              train_on_prompt=False, source="alpaca", line=line)
        assert ex is not None
        assert tok.decode(targets(ex)) == row["output"] + tok.eos_token
