"""The HTTP server's row checks (orchestrator/http/data_rows.py) load a base's tokenizer once, not at each
submission (about a second each), and use it from the row-check threads without failing: a fast (Rust) tokenizer
used by two threads at once can raise "Already borrowed" (orchestrator/http/base_tokenizers.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import actors.storage.sources as sources
from actors.spec.run_spec import RunSpec
from orchestrator.http import data_rows
from orchestrator.http.base_tokenizers import BaseTokenizers
from orchestrator.http.request_bodies import Refused
from orchestrator.jobs_file import check_data_rows

TEMPLATE = {"type": "prompt_response", "prompt": "Q: {question}", "response": " {answer}"}


def _submissions(tmp_path: Path, base: str, bad: bool, rows: int = 400):
    """One job of `rows` long rows (its last one lacking `question` where `bad`), as a jobs file gives it."""
    path = tmp_path / f"{'bad' if bad else 'good'}.jsonl"
    lines = [f'{{"question": "question {i} {"word " * 60}", "answer": "answer {i} {"more " * 60}"}}'
             for i in range(rows)]
    if bad:
        lines[-1] = '{"answer": "no question"}'
    path.write_text("\n".join(lines) + "\n")
    return RunSpec(base_model=base, output_dir=tmp_path / "out", jobs=[
        {"name": "j", "data": str(path), "format": TEMPLATE, "max_steps": 2}])


@pytest.fixture()
def loads(monkeypatch) -> list[str]:
    """The bases whose tokenizers the row checks load (`load_base_tokenizer`, counted), with this process's kept
    tokenizers emptied first."""
    loaded: list[str] = []
    real = sources.load_base_tokenizer

    def counted(base, *args, **kwargs):
        loaded.append(base)
        return real(base, *args, **kwargs)

    monkeypatch.setattr(sources, "load_base_tokenizer", counted)
    monkeypatch.setattr(data_rows, "TOKENIZERS", BaseTokenizers(), raising=False)
    return loaded


def test_two_submissions_load_the_bases_tokenizer_once_and_are_refused_as_aspen_submit_refuses(tmp_path,
                                                                                              tiny_model_dirs, loads):
    base = str(tiny_model_dirs["llama"])
    spec = _submissions(tmp_path, base, bad=True)
    with pytest.raises(Exception) as reference:   # what `aspen submit` (its own tokenizer) says of the same rows
        check_data_rows(spec)
    loads.clear()   # that one was `aspen submit`'s own
    for _ in range(2):
        with pytest.raises(Refused) as refused:
            data_rows.check_rows(spec.submissions(), single_job=False)
        assert "400: field 'question' is missing" in str(refused.value.detail), refused.value.detail
        assert "field 'question' is missing" in str(reference.value)
    assert loads == [base]
    data_rows.check_rows(_submissions(tmp_path, base, bad=False).submissions(), single_job=False)
    assert loads == [base]


def test_row_checks_from_threads_at_once_share_the_tokenizer_without_failing(tmp_path, tiny_model_dirs, loads):
    base = str(tiny_model_dirs["llama"])
    good, bad = (_submissions(tmp_path, base, bad=flag).submissions() for flag in (False, True))
    errors: list[BaseException] = []
    refusals: list[str] = []
    start = threading.Barrier(8)

    def check(submissions) -> None:
        start.wait()
        for _ in range(3):
            try:
                data_rows.check_rows(submissions, single_job=False)
            except Refused as refused:
                refusals.append(str(refused.detail))
            except BaseException as error:  # noqa: BLE001 - each thread's failure is the test's finding
                errors.append(error)

    threads = [threading.Thread(target=check, args=(bad if index % 2 else good,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and len(refusals) == 12, (errors, refusals[:2])
    assert all("400: field 'question' is missing" in refusal for refusal in refusals)
    assert loads == [base]
