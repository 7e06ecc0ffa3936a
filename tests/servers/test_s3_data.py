"""Data on S3 (a real moto server): parquet, JSONL and CSV read from a storage URI, remote data known by size
and time."""

from __future__ import annotations

import os

from actors.data.dataset import load_dataset_examples
from actors.data.digest import job_data_digest
from actors.data.streaming import open_stream
from actors.storage.storage_location import StorageLocation
from tests.helpers.data_files import (
    MAX_LEN,
    QA,
    change_one_row,
    qa_rows,
    reference,
    write_csv,
    write_jsonl,
    write_parquet,
)
from tests.helpers.service import write_task_data


def test_parquet_is_read_from_a_storage_uri(s3_bucket, tmp_path, smol_tokenizer):
    rows = qa_rows(15)
    StorageLocation(f"s3://{s3_bucket}/sets").upload_file(write_parquet(tmp_path / "t.parquet", rows), "t.parquet")
    want = reference(tmp_path, rows, smol_tokenizer)
    uri = f"s3://{s3_bucket}/sets/t.parquet"
    assert load_dataset_examples(uri, QA, smol_tokenizer, max_seq_len=MAX_LEN).examples == want
    stream = open_stream(uri, QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=5, seed=0, epochs=1,
                         shuffle_window=0)
    assert [e for _ in range(3) for e in stream.cursor.next_batch()] == want
    assert stream.train_rows == 15 and stream.cursor.exhausted
    # JSONL under a URI streams too (read a chunk at a time)
    StorageLocation(f"s3://{s3_bucket}/lines").upload_file(write_jsonl(tmp_path / "t.jsonl", rows), "t.jsonl")
    lines = open_stream(f"s3://{s3_bucket}/lines/t.jsonl", QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=5,
                        seed=0, epochs=1, shuffle_window=0)
    assert [e for _ in range(3) for e in lines.cursor.next_batch()] == want and lines.cursor.exhausted
    # CSV under a URI: read whole and streamed, a chunk at a time
    StorageLocation(f"s3://{s3_bucket}/table").upload_file(write_csv(tmp_path / "t.csv", rows), "t.csv")
    assert load_dataset_examples(f"s3://{s3_bucket}/table/t.csv", QA, smol_tokenizer, max_seq_len=MAX_LEN
                                 ).examples == want
    table = open_stream(f"s3://{s3_bucket}/table/t.csv", QA, smol_tokenizer, max_seq_len=MAX_LEN, batch_size=5,
                        seed=0, epochs=1, shuffle_window=0)
    assert [e for _ in range(3) for e in table.cursor.next_batch()] == want and table.cursor.exhausted
    # a folder URI: its parquet files
    assert load_dataset_examples(f"s3://{s3_bucket}/sets", QA, smol_tokenizer, max_seq_len=MAX_LEN).examples == want


def test_streamed_and_remote_data_are_known_by_size_and_time(tmp_path, s3_bucket):
    path = write_task_data(tmp_path, "task")
    digest = job_data_digest(path, streaming=True)
    assert digest.startswith("stat:") and digest != job_data_digest(path)
    stat = path.stat()
    change_one_row(path)                                  # same size; its time given back: not seen (documented)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert job_data_digest(path, streaming=True) == digest
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert job_data_digest(path, streaming=True) != digest

    location = StorageLocation(f"s3://{s3_bucket}/data")
    location.write_bytes("task.jsonl", write_task_data(tmp_path / "remote", "task").read_bytes())
    uri = f"s3://{s3_bucket}/data/task.jsonl"
    remote = job_data_digest(uri)
    assert remote.startswith("stat:") and job_data_digest(uri) == remote
    # rewritten with another row: a new size (the store's modification time has whole seconds only, and this
    # rewrite may well fall in the same second: a same-size rewrite is seen once that second is over)
    rows = (tmp_path / "remote" / "task.jsonl").read_bytes()
    location.write_bytes("task.jsonl", rows.replace(b'"0 task"', b'"0 tasks"'))
    assert job_data_digest(uri) != remote
