"""Data on S3 (a real moto server): parquet, JSONL and CSV read from a storage URI, remote data known by size
and time."""

from __future__ import annotations

import os
import subprocess
import sys

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


def test_a_dataset_uri_without_credentials_is_refused_at_the_run_saying_to_set_them(s3_bucket, tmp_path,
                                                                                     tiny_model_dirs):
    """`aspen run` of a job whose data is on S3, from a shell with no S3 credentials (none in the environment,
    no ~/.aws): the real store refuses the unsigned request, and the run says before anything starts that
    credentials are missing and which variables to set, not that the (absent) credentials lack access."""
    # moto's own client (moto[server]): an object it writes is private to its owner, as on AWS (those pyarrow
    # wrote here were not)
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]).upload_file(
        str(write_parquet(tmp_path / "t.parquet", qa_rows(6))), s3_bucket, "sets/t.parquet")
    (tmp_path / "jobs.yaml").write_text(f"base_model: {tiny_model_dirs['llama']}\noutput_dir: out\njobs:\n"
                                        f"  - name: remote\n    data: s3://{s3_bucket}/sets/t.parquet\n"
                                        "    format: {type: prompt_response, prompt: '{question}', "
                                        "response: ' {answer}'}\n    max_steps: 1\n")
    (tmp_path / "home").mkdir()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("AWS_") or key in ("AWS_ENDPOINT_URL_S3", "AWS_REGION")}
    env["HOME"] = str(tmp_path / "home")
    result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "jobs.yaml"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    said = " ".join(result.stderr.split())
    assert f"jobs.yaml:5: job 'remote', field data: the dataset s3://{s3_bucket}/sets/t.parquet" in said, said
    assert "this process has no S3 credentials" in said and "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in said
    assert "give these credentials" not in said, said
    assert "(nothing was started: fix the storage credentials (or their access to the URI) of the job's data" in said
    assert "fix the rows" not in said, said
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("remote/*")), "the job started"


def test_a_json_array_file_under_a_storage_uri_passes_the_row_check_with_its_rows(s3_bucket, tmp_path, smol_tokenizer):
    """A dataset file holding one JSON array (documented beside JSONL) under s3://: the check `aspen run` / `aspen
    submit` make before anything starts read its first rows line by line and refused it ('each row must be a JSON
    object ({...}), got list'), though the job itself reads it whole; now the check reads the rows Python's json
    reads from the same file, on one line or spread over several."""
    import json

    from actors.data.locations import open_table
    from actors.spec.job_spec import JobSpec
    from orchestrator.jobs_file import data_row_problems

    rows = qa_rows(6)
    for name, text in (("one-line.json", json.dumps(rows)), ("indented.json", json.dumps(rows, indent=2))):
        (tmp_path / name).write_text(text)
        StorageLocation(f"s3://{s3_bucket}/arrays").upload_file(tmp_path / name, name)
        uri = f"s3://{s3_bucket}/arrays/{name}"
        assert [row for _, _, row in open_table(uri).rows(0)] == json.loads((tmp_path / name).read_text()) == rows
        job = JobSpec(name="arrays", data=uri, format=QA, max_seq_len=MAX_LEN)
        assert data_row_problems([job], smol_tokenizer) == [], name


def test_a_dataset_uri_not_in_the_store_is_refused_at_its_line_saying_to_fix_the_uri(s3_bucket, tmp_path,
                                                                                   tiny_model_dirs):
    """`aspen run` of a job whose data names an object, or a bucket, the store (a real S3 server) has not: it said
    'not found; check the dataset URI' under no line of the jobs file and ended with "(nothing was started: fix the
    rows or the format, then run again)", though there were no rows to fix; now the jobs file's line of the job's
    `data` and the fix of its cause, the URI."""
    for uri, said_first in ((f"s3://{s3_bucket}/sets/nothere.jsonl", "not found; check the dataset URI"),
                            ("s3://no-such-bucket-aspen/sets/t.jsonl", "not found; check the dataset URI")):
        (tmp_path / "jobs.yaml").write_text(f"base_model: {tiny_model_dirs['llama']}\noutput_dir: out\njobs:\n"
                                            f"  - name: remote\n    data: {uri}\n"
                                            "    format: {type: prompt_response, prompt: '{q}', response: ' {a}'}\n"
                                            "    max_steps: 1\n")
        result = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "--in-process", "jobs.yaml"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result
        said = " ".join(result.stderr.split())
        assert f"jobs.yaml:5: job 'remote', field data: {uri}: {said_first}" in said, said
        assert "(nothing was started: fix the URI of the job's data, then run again)" in said, said
        assert "fix the rows" not in said, said
        assert not (tmp_path / "out").exists(), "the run left a folder behind"


def test_the_http_apis_refusal_of_a_dataset_uri_not_in_the_store_says_to_fix_the_uri(s3_bucket, tmp_path,
                                                                                     tiny_model_dirs):
    """The HTTP API's row check (what the web console submits through) of a job whose s3:// data the store (a real
    S3 server) has not: a 422 entry typed as a bad row, closing '(fix the rows or the format, then submit again)';
    now typed `data_unreadable` with its fix, at the job's data line, closing with the URI to fix."""
    from actors.spec.job_submission import JobSubmission
    from orchestrator.http.data_rows import check_rows
    from orchestrator.http.request_bodies import Refused
    from tests.helpers.service import job_dict

    uri = f"s3://{s3_bucket}/sets/nothere.jsonl"
    submission = JobSubmission.model_validate({"base_model": str(tiny_model_dirs["llama"]),
                                               "job": job_dict("remote", uri, 1)})
    text = f"base_model: {tiny_model_dirs['llama']}\njobs:\n  - name: remote\n    data: {uri}\n"
    try:
        check_rows([submission], single_job=False, text=text)
    except Refused as refused:
        said = refused
    else:
        raise AssertionError("a dataset the store has not was taken")
    assert said.status == 422 and len(said.errors) == 1, said.errors
    entry = said.errors[0]
    assert entry["type"] == "data_unreadable" and entry["fix"] == "the URI" and "row_field" not in entry, entry
    assert entry["loc"] == ["jobs", 0, "data"] and entry["line"] == 4, entry
    assert f"{uri}: not found; check the dataset URI" in entry["msg"]
    assert said.detail.endswith("(fix the URI of the job's data, then submit again)"), said.detail
