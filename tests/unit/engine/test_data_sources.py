"""Dataset sources beyond one JSON file (actors/data/locations.py, tables.py, csv_table.py, dataset.py,
streaming.py, sharegpt.py): a saved DatasetDict with a split and a column mapping, parquet, arrow, CSV and TSV (as
Python's csv module and pandas write them) and folders of files give the examples the equivalent JSONL gives
(read by the JSONL reader, `load_examples`); ShareGPT rows the tokens and labels of the equivalent `messages`
rows; streaming the batches of the in-memory `DataCursor` (one shuffle window over all rows), reading only the
row groups it needs and resuming exactly from a saved position; errors that name the file, the row (a CSV's
line) and the column; and a job trained from parquet (whole and streamed) in the in-process service, against
the same job trained from JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from actors.data import (
    AlpacaFormat,
    ChatFormat,
    DataCursor,
    DataError,
    load_examples,
    tokenize_example,
)
from actors.data.dataset import load_dataset_examples
from actors.data.streaming import open_stream
from actors.spec.job_spec import JobSpec
from tests.helpers.data_files import MAX_LEN, QA, qa_rows, reference, write_csv, write_jsonl, write_parquet

datasets.disable_progress_bars()


def renamed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with the dataset's own column names (prompt, completion) for a column mapping."""
    return [{"prompt": r["question"], "completion": r["answer"], "id": r["id"]} for r in rows]


COLUMNS = {"question": "prompt", "answer": "completion"}


# ------------------------------------------------------------------------------------------- sources


def test_a_saved_dataset_dict_with_a_split_and_columns_gives_the_jsonl_examples(tmp_path, smol_tokenizer):
    train, test = qa_rows(12), qa_rows(5, offset=100)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(renamed(train)),
                          "test": datasets.Dataset.from_list(renamed(test))}).save_to_disk(str(saved))
    for split, rows in (("train", train), ("test", test)):
        got = load_dataset_examples(saved, QA, smol_tokenizer, max_seq_len=MAX_LEN, split=split, columns=COLUMNS)
        assert got.examples == reference(tmp_path, rows, smol_tokenizer)
    single = tmp_path / "single"
    datasets.Dataset.from_list(train).save_to_disk(str(single))   # a Dataset (no splits)
    assert (load_dataset_examples(single, QA, smol_tokenizer, max_seq_len=MAX_LEN).examples
            == reference(tmp_path, train, smol_tokenizer))
    with pytest.raises(DataError, match=r"saved: the dataset has no split 'validation'; its splits: train, test"):
        load_dataset_examples(saved, QA, smol_tokenizer, max_seq_len=MAX_LEN, split="validation", columns=COLUMNS)
    with pytest.raises(DataError, match=r"single: split 'test' was asked for, but this data has no splits"):
        load_dataset_examples(single, QA, smol_tokenizer, max_seq_len=MAX_LEN, split="test")


def _arrow_stream(path: Path, rows: list[dict[str, Any]]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    return path


def _arrow_file(path: Path, rows: list[dict[str, Any]]) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    return path


@pytest.mark.parametrize("kind", ["parquet", "arrow-stream", "arrow-file", "jsonl-folder", "parquet-hub-folder"])
def test_files_and_folders_give_the_jsonl_examples(kind, tmp_path, smol_tokenizer):
    rows = qa_rows(23)
    if kind == "parquet":
        data = write_parquet(tmp_path / "train.parquet", rows)
    elif kind == "arrow-stream":
        data = _arrow_stream(tmp_path / "train.arrow", rows)
    elif kind == "arrow-file":
        data = _arrow_file(tmp_path / "train.arrow", rows)
    elif kind == "jsonl-folder":   # no file names a split: every file, in name order
        data = tmp_path / "folder"
        write_jsonl(data / "part-0.jsonl", rows[:10])
        write_jsonl(data / "part-1.jsonl", rows[10:])
        (data / "README.md").write_text("not data")
    else:   # the layout of a hub snapshot: data/<split>-0000i-of-0000n.parquet
        data = tmp_path / "snapshot"
        write_parquet(data / "data" / "train-00000-of-00002.parquet", rows[:9])
        write_parquet(data / "data" / "train-00001-of-00002.parquet", rows[9:])
        write_parquet(data / "data" / "test-00000-of-00001.parquet", qa_rows(3, offset=50))
    got = load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN)
    assert got.examples == reference(tmp_path, rows, smol_tokenizer)
    if kind == "parquet-hub-folder":
        test = load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, split="test")
        assert test.examples == reference(tmp_path, qa_rows(3, offset=50), smol_tokenizer)
        with pytest.raises(DataError, match=r"no split 'dev'; its splits \(by file name\): test, train"):
            load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, split="dev")


TRICKY = [{"question": 'a "quoted" word, a comma, and\na line break', "answer": "tab\there; semicolon;"},
          {"question": "unicode: naïve café — 東京 🚀", "answer": ""},
          {"question": "  leading and trailing spaces  ", "answer": "\r\nCRLF inside\r\n"},
          *({"question": f"what is {i} plus {2 * i}?", "answer": f"{3 * i}"} for i in range(20))]


@pytest.mark.parametrize("writer", ["csv-module", "pandas", "tsv", "utf-8-bom", "csv-folder"])
def test_csv_and_tsv_files_give_the_jsonl_examples(writer, tmp_path, smol_tokenizer, monkeypatch):
    """Quoted delimiters, doubled quotes, line breaks inside a field, non-ASCII text, an empty field: a CSV file as
    Python's csv module writes it (\\r\\n line ends), as pandas writes it (datasets' `to_csv`, \\n), a TSV, a CSV
    with a byte-order mark (Excel's "CSV UTF-8") and a folder of CSV files give the examples of the same rows
    in JSONL; read 7 bytes at a time, so that records, line breaks and multi-byte characters straddle reads."""
    import actors.data.tables as tables

    monkeypatch.setattr(tables, "JSONL_CHUNK_BYTES", 7)
    if writer == "csv-module":
        data = write_csv(tmp_path / "t.csv", TRICKY)
    elif writer == "pandas":
        data = tmp_path / "t.csv"
        datasets.Dataset.from_list(TRICKY).to_csv(str(data), index=False)
    elif writer == "tsv":
        data = write_csv(tmp_path / "t.tsv", TRICKY, delimiter="\t")
    elif writer == "utf-8-bom":
        data = write_csv(tmp_path / "t.csv", TRICKY, encoding="utf-8-sig")
        assert data.read_bytes().startswith(b"\xef\xbb\xbf")
    else:
        data = tmp_path / "folder"
        write_csv(data / "part-0.csv", TRICKY[:7])
        write_csv(data / "part-1.csv", TRICKY[7:])
    got = load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN)
    assert got.examples == reference(tmp_path, TRICKY, smol_tokenizer)


def test_csv_errors_name_the_line_an_editor_shows(tmp_path, smol_tokenizer):
    """A record with a field too many (counted after a record whose quoted field spans two lines), an unclosed
    quote, a header without a name or with one twice, bytes that are not UTF-8: each refused at its line."""
    def refused(text: bytes, pattern: str) -> None:
        path = tmp_path / "bad.csv"
        path.write_bytes(text)
        with pytest.raises(DataError, match=pattern):
            load_dataset_examples(path, QA, smol_tokenizer, max_seq_len=MAX_LEN)

    refused(b'question,answer\n"two\nlines",1\nthree,fields,here\n',
            r"bad.csv:4: 3 fields where the header names 2 columns; quote a field that holds the delimiter \(','\)")
    refused(b'question,answer\nfine,1\n"never closed,2\n', r"bad.csv:3: not a readable CSV record")
    refused(b"question,,answer\na,b,c\n", r"bad.csv:1: the header row has an empty column name \(column 2\)")
    refused(b"question,answer,question\na,b,c\n", r"bad.csv:1: the header row names 'question' more than once")
    refused(b"question,answer\nfine,1\ncaf\xe9,2\n", r"bad.csv:3: not valid UTF-8 .*re-save the file as UTF-8")
    refused(b"question,answer\n", r"bad.csv: the dataset holds no rows")


# ------------------------------------------------------------------------------------------- ShareGPT


CONVERSATIONS = [
    [("system", "You answer in one word."), ("human", "Capital of France?"), ("gpt", "Paris."),
     ("human", "And of Italy?"), ("gpt", "Rome.")],
    [("human", "Say hi."), ("gpt", "Hi!")],
    [("user", "Two plus two?"), ("assistant", "Four.")],
]
ROLE = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def test_sharegpt_rows_give_the_tokens_and_labels_of_messages_rows(tmp_path, smol_tokenizer):
    sharegpt = [{"conversations": [{"from": who, "value": text} for who, text in c]} for c in CONVERSATIONS]
    messages = [{"messages": [{"role": ROLE[who], "content": text} for who, text in c]} for c in CONVERSATIONS]
    as_messages = ChatFormat(type="chat")
    as_sharegpt = ChatFormat(type="chat", messages_field="conversations")
    for share_row, message_row, conversation in zip(sharegpt, messages, CONVERSATIONS, strict=True):
        got = tokenize_example(share_row, as_sharegpt, smol_tokenizer, max_seq_len=256)
        want = tokenize_example(message_row, as_messages, smol_tokenizer, max_seq_len=256)
        assert got == want
        # the loss is on the assistant turns only: the target text is their contents (and the end markers)
        target_text = smol_tokenizer.decode([t for t in got.labels if t != -100])
        for who, text in conversation:
            assert (text in target_text) == (ROLE[who] == "assistant"), (who, text, target_text)
    # the same conversations in a parquet file (a list of {from, value} structs) and a JSONL file
    reference_examples = load_examples(write_jsonl(tmp_path / "m.jsonl", messages), as_messages, smol_tokenizer,
                                       max_seq_len=256).examples
    parquet = write_parquet(tmp_path / "s.parquet", sharegpt, row_group_size=2)
    for data in (parquet, write_jsonl(tmp_path / "s.jsonl", sharegpt)):
        assert load_dataset_examples(data, as_sharegpt, smol_tokenizer, max_seq_len=256).examples == reference_examples
    bad = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}]
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'conversations\[1\].from' is 'bot', not a ShareGPT role"):
        load_dataset_examples(write_jsonl(tmp_path / "bad.jsonl", bad), as_sharegpt, smol_tokenizer, max_seq_len=256)


# ------------------------------------------------------------------------------------------- streaming


def _batches(cursor: Any, count: int) -> list:
    return [cursor.next_batch() for _ in range(count)]


WRITERS = {"parquet": write_parquet, "jsonl": write_jsonl, "csv": write_csv}


@pytest.mark.parametrize("suffix", ["parquet", "jsonl", "csv"])
def test_streaming_with_one_window_gives_the_in_memory_batches(suffix, tmp_path, smol_tokenizer):
    rows = qa_rows(30)
    data = WRITERS[suffix](tmp_path / f"t.{suffix}", rows)
    examples = reference(tmp_path, rows, smol_tokenizer)
    for epochs in (None, 2):   # max_steps: the data repeats; epochs: it ends, with a short last batch
        in_memory = DataCursor(examples, 4, seed=11, epochs=epochs)
        stream = open_stream(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=11, epochs=epochs,
                             shuffle_window=len(rows)).cursor
        for _ in range(40):
            want, got = in_memory.next_batch(), stream.next_batch()
            assert got == want
            assert stream.exhausted == in_memory.exhausted
            if want is None:
                break
        assert epochs is None or in_memory.exhausted


def test_streaming_reads_row_groups_as_it_needs_them(tmp_path, smol_tokenizer, monkeypatch):
    rows = qa_rows(400)
    data = write_parquet(tmp_path / "big.parquet", rows, row_group_size=10)   # 40 row groups
    assert pq.ParquetFile(data).metadata.num_row_groups == 40
    reads: list[int] = []
    original = pq.ParquetFile.read_row_group

    def counted(self, group, *args, **kwargs):
        reads.append(group)
        return original(self, group, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    stream = open_stream(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=5, epochs=None,
                         shuffle_window=25)
    assert reads == [] and stream.train_rows == 400   # the row count comes from the metadata
    first = stream.cursor.next_batch()
    assert reads == [0, 1, 2]   # the first window (rows 0-24) and nothing more
    window = reference(tmp_path, rows[:25], smol_tokenizer)
    assert all(example in window for example in first) and first != window[:4]   # shuffled within the window
    _batches(stream.cursor, 30)   # 124 examples: windows 0-4 (rows 0-124)
    assert reads == list(range(13))
    # resuming far into the data reads from the window of the position on, not from the start
    reads.clear()
    fresh = open_stream(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=5, epochs=None,
                        shuffle_window=25).cursor
    fresh.load_state_dict({"epoch": 0, "position": 300, "examples_seen": 300, "seed": 5, "window": 25,
                           "first_row": 0})
    fresh.next_batch()
    assert reads == [30, 31, 32]


@pytest.mark.parametrize("suffix", ["parquet", "jsonl", "csv"])
def test_streaming_resumes_exactly_from_a_saved_position(suffix, tmp_path, smol_tokenizer):
    rows = qa_rows(45)
    data = WRITERS[suffix](tmp_path / f"t.{suffix}", rows)

    def cursor():
        return open_stream(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=3, epochs=None,
                           eval_rows=5, shuffle_window=8).cursor

    uninterrupted = cursor()
    expected = _batches(uninterrupted, 40)   # 160 examples: 4 epochs of 40 training rows
    for stop in (0, 1, 2, 9, 10, 23):   # inside a window, at window and epoch boundaries
        first = cursor()
        _batches(first, stop)
        state = json.loads(json.dumps(first.state_dict()))   # as a checkpoint stores it
        resumed = cursor()
        resumed.load_state_dict(state)
        lengths = resumed.peek_lengths(2)
        assert _batches(resumed, 40 - stop) == expected[stop:]
        assert lengths == [len(e) for batch in expected[stop:stop + 2] for e in batch]
    # the eval rows (the first 5) are never trained on
    eval_examples = reference(tmp_path, rows[:5], smol_tokenizer)
    assert not any(e in eval_examples for batch in expected for e in batch)
    with pytest.raises(ValueError, match="window=16 but this stream has window=8"):
        cursor().load_state_dict({**uninterrupted.state_dict(), "window": 16})


def test_streaming_eval_split_is_a_count_of_first_rows(tmp_path, smol_tokenizer):
    rows = qa_rows(20)
    data = write_parquet(tmp_path / "t.parquet", rows)
    stream = open_stream(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=0, epochs=1,
                         eval_rows=6, shuffle_window=0)
    assert stream.eval == reference(tmp_path, rows[:6], smol_tokenizer) and stream.train_rows == 14
    assert [e for b in _batches(stream.cursor, 4) for e in b] == reference(tmp_path, rows[6:], smol_tokenizer)
    assert stream.cursor.next_batch() is None and stream.cursor.exhausted
    spec = {"name": "s", "data": str(data), "format": {"type": "alpaca"}, "streaming": True, "max_steps": 5}
    with pytest.raises(ValidationError, match="eval_split=0.1 is a fraction, which streaming cannot take"):
        JobSpec.model_validate({**spec, "eval_split": 0.1})
    assert JobSpec.model_validate({**spec, "eval_split": 6}).eval_split == 6
    json_array = tmp_path / "array.json"
    json_array.write_text(json.dumps(rows))
    with pytest.raises(DataError, match="array.json: a JSON array is read whole, so it cannot be streamed"):
        open_stream(json_array, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=0, epochs=None)


# ------------------------------------------------------------------------------------------- errors


def test_errors_name_the_file_the_row_and_the_column(tmp_path, smol_tokenizer):
    rows = qa_rows(10)
    parquet = write_parquet(tmp_path / "t.parquet", renamed(rows))
    with pytest.raises(DataError, match=r"t.parquet, row 0: column 'answer_text' is missing \(columns maps the "
                                        r"format's field 'answer' to it; the row's columns: completion, id, prompt\)"):
        load_dataset_examples(parquet, QA, smol_tokenizer, max_seq_len=MAX_LEN,
                              columns={"question": "prompt", "answer": "answer_text"})
    with pytest.raises(DataError, match=r"t.parquet, row 0: field 'question' is missing .*the row has: completion, "
                                        r"id, prompt"):
        load_dataset_examples(parquet, QA, smol_tokenizer, max_seq_len=MAX_LEN)
    nulls = [dict(r) for r in rows]
    nulls[7]["answer"] = None
    with pytest.raises(DataError, match=r"nulls.parquet, row 7: field 'answer' must be a string, got null"):
        load_dataset_examples(write_parquet(tmp_path / "nulls.parquet", nulls), QA, smol_tokenizer,
                              max_seq_len=MAX_LEN)
    # streamed, the bad row fails the batch whose window holds it (the job then fails with this message)
    cursor = open_stream(tmp_path / "nulls.parquet", QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=4, seed=0,
                         epochs=None, shuffle_window=5).cursor
    assert len(cursor.next_batch()) == 4   # window 0: rows 0-4
    with pytest.raises(DataError, match=r"nulls.parquet, row 7: field 'answer' must be a string, got null"):
        cursor.next_batch()
    numbers = [{"question": r["question"], "answer": r["id"] + 0.5} for r in rows]
    with pytest.raises(DataError, match=r"numbers.parquet, row 0: field 'answer' must be a string, got float \(a "
                                        r"whole number is read as its digits; write other values as text"):
        load_dataset_examples(write_parquet(tmp_path / "numbers.parquet", numbers), QA, smol_tokenizer,
                              max_seq_len=MAX_LEN)
    whole = [{"question": r["question"], "answer": 1000 + r["id"]} for r in rows]   # int64 in parquet: its digits
    texts = [{"question": r["question"], "answer": str(1000 + r["id"])} for r in rows]
    assert [e.input_ids for e in load_dataset_examples(write_parquet(tmp_path / "whole.parquet", whole), QA,
                                                       smol_tokenizer, max_seq_len=MAX_LEN).examples] == \
        [e.input_ids for e in load_dataset_examples(write_parquet(tmp_path / "texts.parquet", texts), QA,
                                                    smol_tokenizer, max_seq_len=MAX_LEN).examples]
    gap = [dict(r) for r in rows]
    del gap[3]["answer"]
    with pytest.raises(DataError, match=r"gap.jsonl:4: field 'answer' is missing"):   # JSONL: the line
        load_dataset_examples(write_jsonl(tmp_path / "gap.jsonl", gap), QA, smol_tokenizer, max_seq_len=MAX_LEN)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    with pytest.raises(DataError, match=r"broken.parquet: not a readable parquet file: pyarrow says: .*magic bytes"):
        load_dataset_examples(broken, QA, smol_tokenizer, max_seq_len=MAX_LEN)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"empty: the folder holds no data files"):
        load_dataset_examples(empty, QA, smol_tokenizer, max_seq_len=MAX_LEN)


def test_a_hub_id_is_refused_with_what_to_do(tmp_path, smol_tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"'tatsu-lab/alpaca' is no file or folder here and looks like a Hugging "
                                        r"Face hub dataset; aspen downloads nothing at run time: .*save_to_disk"):
        load_dataset_examples("tatsu-lab/alpaca", AlpacaFormat(), smol_tokenizer, max_seq_len=MAX_LEN)
    with pytest.raises(ValidationError, match="hf://datasets/tatsu-lab/alpaca' is no file or folder here and looks "
                                              "like a Hugging Face hub dataset"):
        JobSpec.model_validate({"name": "j", "data": "hf://datasets/tatsu-lab/alpaca", "format": {"type": "alpaca"}})
    from orchestrator.jobs_file import SpecError, parse_run_spec

    with pytest.raises(SpecError, match=r"job 'j' \(jobs\[0\]\), field data: 'tatsu-lab/alpaca' is no file or folder "
                                        "here and looks like a Hugging Face hub dataset"):
        parse_run_spec({"jobs": [{"name": "j", "data": "tatsu-lab/alpaca", "format": {"type": "alpaca"}}]},
                       base_dir=tmp_path)
    # a folder is a dataset too (a saved one), and a column mapping names only the format's fields
    datasets.Dataset.from_list(qa_rows(3)).save_to_disk(str(tmp_path / "saved"))
    run = parse_run_spec({"jobs": [{"name": "j", "data": "saved", "format": {"type": "alpaca"},
                                    "columns": {"instruction": "question", "output": "answer"}}]}, base_dir=tmp_path)
    assert run.jobs[0].columns == {"instruction": "question", "output": "answer"}
    with pytest.raises(SpecError, match=r"columns maps answer, not a field of format alpaca \(its fields: input, "
                                        r"instruction, output\)"):
        parse_run_spec({"jobs": [{"name": "j", "data": "saved", "format": {"type": "alpaca"},
                                  "columns": {"answer": "answer"}}]}, base_dir=tmp_path)


# ------------------------------------------------------------------------------------------- a job


def test_a_job_trains_from_parquet_whole_and_streamed_as_from_jsonl(tmp_path, tiny_model_dirs, smol_tokenizer):
    """The service's job data (`JobData`) of a parquet job with a column mapping, and of a CSV job, holds the
    JSONL job's examples, eval split included; and two jobs in one in-process run (`train_locally`): JSONL, and the same
    rows as parquet streamed with one shuffle window over all of them. Same seed, so the same data order: the
    same adapter."""
    from actors.engine.models import load_base_model
    from actors.service.scheduler.job_data import JobData
    from actors.service.scheduler.local_run import train_locally
    from actors.spec.job_submission import JobSubmission
    from tests.helpers.service import adapter_tensors, job_dict, max_relative_difference, run_spec

    rows = qa_rows(24)
    jsonl = write_jsonl(tmp_path / "qa.jsonl", rows)
    parquet = write_parquet(tmp_path / "qa.parquet", renamed(rows), row_group_size=5)
    steps = 3
    prepared = []
    csv = write_csv(tmp_path / "qa.csv", rows)
    for data, extra in ((jsonl, {}), (parquet, {"columns": COLUMNS}), (csv, {})):
        job = JobSpec.model_validate(job_dict("j", data, steps, eval_split=0.25, **extra))
        job_data = JobData("j", JobSubmission(job=job, seed=4), smol_tokenizer)
        summary = job_data.prepare()
        prepared.append((summary.train_examples, summary.eval_examples, job_data.eval_examples(),
                         job_data.fetch(summary.start, 5).batches))
    assert prepared[0] == prepared[1] == prepared[2] and prepared[0][:2] == (18, 6)

    spec = run_spec(str(tiny_model_dirs["llama"]), tmp_path / "out", [
        job_dict("from-jsonl", jsonl, steps),
        job_dict("streamed", parquet, steps, columns=COLUMNS, streaming=True, shuffle_window=64),
    ])
    base = load_base_model(str(tiny_model_dirs["llama"]), dtype="float32", device="cpu")
    results = train_locally(spec, base=base, progress=False)
    assert [(r.state, r.steps) for r in results] == [("completed", steps)] * 2, [r.reason for r in results]
    reference_adapter = adapter_tensors(tmp_path / "out" / "from-jsonl")
    assert any(float(t.abs().max()) > 0 for key, t in reference_adapter.items() if "lora_B" in key)
    assert max_relative_difference(adapter_tensors(tmp_path / "out" / "streamed"), reference_adapter) < 1e-5


def test_dotted_columns_reach_values_nested_in_a_row(tmp_path, smol_tokenizer):
    """`columns: {answer: answers.text.0}`: a value nested in objects and lists (as SQuAD's answers, or the
    self-instruct seed tasks' instances) gives the examples of the same rows with flat columns, from JSONL and from
    parquet (struct and list columns); a path the row lacks names where it stops and what is there."""
    rows = qa_rows(9)
    nested = [{"q": {"text": r["question"], "lang": "en"}, "answers": {"text": [r["answer"], "wrong"]}, "id": r["id"]}
              for r in rows]
    paths = {"question": "q.text", "answer": "answers.text.0"}
    expected = reference(tmp_path, rows, smol_tokenizer)
    for data in (write_jsonl(tmp_path / "nested.jsonl", nested), write_parquet(tmp_path / "nested.parquet", nested)):
        got = load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, columns=paths)
        assert got.examples == expected
    last = load_dataset_examples(write_jsonl(tmp_path / "last.jsonl", nested), QA, smol_tokenizer, max_seq_len=MAX_LEN,
                                 columns={"question": "q.text", "answer": "answers.text.-1"})
    assert last.examples == reference(tmp_path, [{**r, "answer": "wrong"} for r in rows], smol_tokenizer)
    a_dotted_name = [{"q.text": r["question"], "answer": r["answer"]} for r in rows]   # a column named with a dot
    got = load_dataset_examples(write_jsonl(tmp_path / "dotted.jsonl", a_dotted_name), QA, smol_tokenizer,
                                max_seq_len=MAX_LEN, columns={"question": "q.text"})
    assert got.examples == expected
    data = tmp_path / "nested.jsonl"
    for columns, why in (({"answer": "answers.text.5"}, "'answers.text' is a list of 2: '5' is not an index of it"),
                         ({"question": "q.body"}, "'q' is an object without 'body'; its keys: lang, text"),
                         ({"answer": "id.value"}, "'id' holds 0, not an object or a list"),
                         ({"answer": "reply.text"}, "the row's columns: answers, id, q")):
        with pytest.raises(DataError) as refused:
            load_dataset_examples(data, QA, smol_tokenizer, max_seq_len=MAX_LEN, columns=columns)
        assert "nested.jsonl:1" in str(refused.value) and why in str(refused.value), str(refused.value)
    with pytest.raises(ValidationError, match=r"use a plain name and map it with columns, e.g. '\{text\}' with "
                                              r"columns: \{text: q.text\}"):
        JobSpec.model_validate({"name": "j", "data": str(data), "format": {"type": "prompt_response",
                                                                           "prompt": "{q.text}", "response": "{a}"}})
