"""A jobs file's data rows checked before anything starts (issue: bad rows found only after the service had
started and trained): `aspen run` refuses, within seconds and with nothing started, a row that is not valid JSON,
a template naming a field the rows lack, text the tokenizer cannot encode (a lone surrogate), data whose every
row truncates away and an eval_split that leaves nothing to train on, each with the message the job would have
failed with; good jobs are untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.data.formats import PromptResponseFormat
from actors.data.row_check import check_job_rows
from actors.data.rows import DataError
from actors.spec.job_spec import JobSpec

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = {"type": "prompt_response", "prompt": "Q: {question}", "response": " {answer}"}
TEMPLATE_FORMAT = PromptResponseFormat(**TEMPLATE)


def _write(path: Path, rows: list[str]) -> Path:
    path.write_text("".join(row + "\n" for row in rows))
    return path


def _rows(count: int = 20) -> list[str]:
    return [json.dumps({"question": f"what is {i}?", "answer": f"{i}"}) for i in range(count)]


def _job(data: Path, **fields) -> JobSpec:
    return JobSpec(name="j", data=data, format=fields.pop("format", TEMPLATE), max_steps=2, **fields)


def test_every_row_of_a_local_file_is_read_and_tokenized(tmp_path, smol_tokenizer):
    rows = _rows()
    assert check_job_rows(_job(_write(tmp_path / "good.jsonl", rows)), smol_tokenizer) == (20, True)
    bad = rows[:]
    bad[16] = '{"question": "q", "answer": '
    with pytest.raises(DataError, match=r"bad.jsonl:17: invalid JSON"):
        check_job_rows(_job(_write(tmp_path / "bad.jsonl", bad)), smol_tokenizer)
    with pytest.raises(DataError, match=r"good.jsonl:1: field 'questio' is missing .* the row has: answer, question"):
        check_job_rows(_job(tmp_path / "good.jsonl", format={**TEMPLATE, "prompt": "Q: {questio}"}), smol_tokenizer)
    odd = rows[:]
    odd[4] = '{"question": "a\\ud800b", "answer": "x"}'
    with pytest.raises(DataError, match=r"odd.jsonl:5: field 'question' holds text the tokenizer cannot encode"):
        check_job_rows(_job(_write(tmp_path / "odd.jsonl", odd)), smol_tokenizer)
    long_prompt = {**TEMPLATE, "prompt": "Answer the following question briefly and correctly please: {question}"}
    with pytest.raises(DataError, match=r"all 20 rows were dropped"):
        check_job_rows(_job(tmp_path / "good.jsonl", max_seq_len=8, format=long_prompt), smol_tokenizer)


def test_an_eval_split_that_leaves_nothing_to_train_on_is_refused_as_the_job_would_fail(tmp_path, smol_tokenizer):
    """eval_split counts examples, not rows: rows that truncate away are not there to hold out. The refusal says so
    and carries what the job actor itself fails with (its own data preparation, `JobData.prepare`)."""
    from actors.service.scheduler.job_data import JobData
    from actors.spec.job_submission import JobSubmission

    path = _write(tmp_path / "qa.jsonl", _rows(20)[:15] + [json.dumps({"question": "long " * 40, "answer": "x"})] * 5)
    assert check_job_rows(_job(path, eval_split=14, max_seq_len=32), smol_tokenizer) == (20, True)
    job = _job(path, eval_split=15, max_seq_len=32)
    with pytest.raises(DataError) as actor:
        JobData("j", JobSubmission(job=job, seed=0), smol_tokenizer).prepare()
    with pytest.raises(DataError) as checked:
        check_job_rows(job, smol_tokenizer)
    assert str(actor.value) == "eval_split=15.0 takes 15 of 15 examples, leaving none to train on; lower eval_split " \
                               "below 15 or add data"
    assert str(checked.value) == (f"{path}: {actor.value} (5 of 20 rows have no target token left after truncation "
                                  "to max_seq_len=32)")
    assert checked.value.field == "eval_split"


def test_a_lone_surrogate_in_a_chat_message_is_named_with_its_place(tmp_path, smol_tokenizer):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\udc00"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"chat.jsonl:1: field 'messages\[1\].content' holds text the tokenizer"):
        check_job_rows(_job(path, format={"type": "chat"}), smol_tokenizer)


def test_a_streamed_dataset_is_checked_on_its_first_rows_only(tmp_path, smol_tokenizer):
    rows = _rows(30)
    rows[25] = "not json"
    path = _write(tmp_path / "big.jsonl", rows)
    checked, whole = check_job_rows(_job(path, streaming=True), smol_tokenizer, sample_rows=10)
    assert (checked, whole) == (10, False)   # the row at line 26 is the stream's to meet (as its job reads on)



def test_a_streamed_eval_split_is_refused_as_its_job_would_refuse_it(tmp_path, smol_tokenizer):
    """A streaming job's eval split is its first rows: every row of a small file read, a split taking them all is
    refused before start (the job failed minutes later); a split whose rows all truncate away, which left the job
    training without one evaluation and saying nothing, is refused by the job and by the check with one message;
    a JSON array, which no stream can read, says so rather than that its first line is not a JSON row."""
    from actors.data.streaming import open_stream

    short = [json.dumps({"question": "long " * 40, "answer": "x"})] * 3
    path = _write(tmp_path / "qa.jsonl", short + _rows(10))
    with pytest.raises(DataError, match=r"qa.jsonl: eval_split=13 takes all 13 rows, leaving none to train on"):
        check_job_rows(_job(path, streaming=True, eval_split=13), smol_tokenizer)
    job = _job(path, streaming=True, eval_split=3, max_seq_len=32)
    with pytest.raises(DataError) as checked:
        check_job_rows(job, smol_tokenizer)
    with pytest.raises(DataError) as streamed:
        open_stream(path, TEMPLATE_FORMAT, smol_tokenizer, max_seq_len=32, batch_size=2, seed=0, epochs=None,
                    eval_rows=3)
    assert str(checked.value) == str(streamed.value) == (
        f"{path}: none of the eval split's 3 rows (the first) has a target token left after truncation to "
        "max_seq_len=32; raise max_seq_len or eval_split")
    assert check_job_rows(_job(path, streaming=True, eval_split=4, max_seq_len=32), smol_tokenizer) == (13, True)
    array = tmp_path / "qa.json"
    array.write_text(json.dumps([json.loads(row) for row in _rows(4)], indent=1))
    with pytest.raises(DataError, match=r"a JSON array is read whole, so it cannot be streamed; write one object per "
                                        r"line \(JSONL\) or parquet, or set streaming: false"):
        check_job_rows(_job(array, streaming=True), smol_tokenizer)

def test_aspen_run_refuses_bad_rows_before_anything_starts(tmp_path, tiny_model_dirs):
    """The user's command: `aspen run jobs.yaml` with one good job and two bad ones: exit 2 in seconds (no service,
    no model weights), each bad job's first bad row named, the good one not, and nothing written."""
    rows = _rows()
    _write(tmp_path / "good.jsonl", rows)
    rows[6] = '{"question": 1.5, "answer": "2"}'
    _write(tmp_path / "typed.jsonl", rows)
    (tmp_path / "jobs.yaml").write_text(f"""\
base_model: {tiny_model_dirs['llama']}
output_dir: out
jobs:
  - {{name: good, data: good.jsonl, format: {json.dumps(TEMPLATE)}, max_steps: 2}}
  - {{name: typo, data: good.jsonl, format: {json.dumps({**TEMPLATE, "prompt": "Q: {questio}"})}, max_steps: 2}}
  - {{name: typed, data: bad/../typed.jsonl, format: {json.dumps(TEMPLATE)}, max_steps: 2}}
""")
    (tmp_path / "bad").mkdir()   # the path as written, `bad/..` in it: messages name the file plainly
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "jobs.yaml"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO),
                                                       "RAY_ADDRESS": "127.0.0.1:9"})   # nothing answers there
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert time.monotonic() - started < 60
    assert f"job 'typo': {tmp_path / 'good.jsonl'}:1: field 'questio' is missing" in out.stderr, out.stderr
    assert f"job 'typed': {tmp_path / 'typed.jsonl'}:7: field 'question' must be a string" in out.stderr
    assert "job 'good'" not in out.stderr and "Traceback" not in out.stderr
    assert "nothing was started" in out.stderr
    assert not (tmp_path / "out").exists()


def test_a_path_is_tidied_only_where_it_names_the_same_file(tmp_path):
    from orchestrator.jobs_file import tidy_path

    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "plain").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere" / "deep")
    assert tidy_path(tmp_path / "plain" / ".." / "data" / "x.jsonl") == str(tmp_path / "data" / "x.jsonl")
    assert tidy_path(f"{tmp_path}/./data/x.jsonl") == str(tmp_path / "data" / "x.jsonl")
    linked = f"{tmp_path}/link/../x.jsonl"   # the link's `..` is elsewhere/: not the same file as tmp_path/x.jsonl
    assert tidy_path(linked) == linked


def test_a_fraction_held_out_of_a_single_example_is_told_what_can_help(tmp_path):
    """A fraction holds out at least one example: with one, lowering it cannot help (the advice was "lower
    eval_split"); the refusal says to add data or hold none out."""
    from actors.data.batches import split_eval

    with pytest.raises(DataError, match=r"eval_split=0\.05 takes 1 of 1 examples, leaving none to train on; add data "
                                        r"\(a fraction holds out at least one example\) or set eval_split: 0$"):
        split_eval(["only"], 0.05, seed=0)
