"""A submission's data rows (a sweep's: its job's) checked before its jobs are entered (its sweep started), as `aspen
submit` checks them (orchestrator/jobs_file.py:data_row_problems, actors/data/row_check.py): each job's first row
that does not fit its format (a template field the rows lack, a row that is not JSON, text the tokenizer cannot
encode, rows that all truncate away, an eval_split that leaves nothing to train on) refused with a 422 naming the
job, the data file's row and field and what to write, rather than the job failing on it seconds after it started. A
local file is read whole, the first `REMOTE_SAMPLE_ROWS` of a storage URI or a streamed dataset, once here (the job
reads them again as it trains, as after `aspen submit`).

Only submissions the service would take are read (`Client.check_submissions` first): a user's request reads no
data outside where they may read. Where this machine has no tokenizer of a job's base model (a base no trainer
here holds), its rows are checked when the job starts. Ray-free; imports the tokenizer's code on first use."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException

from actors.data.rows import DataUnreadable
from actors.spec.job_submission import JobSubmission
from actors.spec.sweep_spec import SweepSpec
from actors.storage.storage_errors import StorageUnreachable
from orchestrator.http.base_tokenizers import TOKENIZERS, TokenizerUnavailable
from orchestrator.http.request_bodies import refusal
from orchestrator.jobs_file import data_row_problems, yaml_lines
from orchestrator.row_checks import settings_text, space_field, sweep_row_problems

log = logging.getLogger("orchestrator.http.api")

ROW_CHECK_THREADS = 2   # submissions whose rows are read at once (a local file is read whole); more wait their turn


def _then(problems: list[dict[str, Any]]) -> str:
    """The refusal's closing advice, fit to each problem's cause: the rows or the format for a bad row, or for a
    dataset that cannot be read at all what to fix instead (its `fix`: the URI, the storage credentials...)."""
    fixes = dict.fromkeys(f"{problem['fix']} of the job's data" if "fix" in problem else "the rows or the format"
                          for problem in problems)
    return f"(fix {' and '.join(fixes)}, then submit again)"


@contextmanager
def store_answering() -> Iterator[None]:
    """A store that could not be reached at all (`StorageUnreachable`: connection refused, a name that does not
    resolve) while a job's rows were read: a 502 saying which job, URI and endpoint and what to check, as `aspen
    submit` over Ray says it (exit 1: nothing is wrong with the request, nothing was entered)."""
    try:
        yield
    except StorageUnreachable as error:
        raise HTTPException(502, str(error)) from None


def check_rows(submissions: list[JobSubmission], *, single_job: bool, text: str | None = None) -> None:
    """`Refused` (422) naming each job's first bad row; `single_job`: the body was one job's fields (its problems
    located as `data`, not `jobs.0.data`); `text`: a jobs file's YAML text (each problem then gives the line of its
    job's `data`, which the console marks)."""
    index_of = {submission.job.name: index for index, submission in enumerate(submissions)}
    with store_answering():
        problems = _row_problems(submissions, index_of, single_job)
    if not problems:
        return
    lines = yaml_lines(text) if text and not single_job else {}
    for problem in problems:
        line = lines.get(tuple(problem["loc"]))
        if line is not None:
            problem["line"] = line
    problems.sort(key=lambda problem: index_of[problem["job"]])
    raise refusal(problems, single_job, [submission.job.name for submission in submissions], then=_then(problems))


def check_sweep_rows(spec: SweepSpec, text: str | None = None) -> None:
    """`Refused` (422) naming the first row of a sweep's data that does not fit its job's format, as `check_rows`
    names a job's (located at `job.data`, or `job.eval_split`; `text`: the sweep file's YAML, each problem then with
    the line of that field). Its rows are read for every combination of the space's values that changes how they
    read (`SweepSpec.row_jobs`: max_seq_len, eval_split, ...); a combination's problem is located at its space field
    (`loc: ["space", "max_seq_len"]`), its settings in `settings` and the message."""
    try:
        with TOKENIZERS.held(spec.base_model) as tokenizer, store_answering():   # one thread uses it at a time
            found = sweep_row_problems(spec, tokenizer)
    except TokenizerUnavailable as error:   # not on this machine: the rows are checked when the trials start
        log.info("aspen http: rows of sweep %s not checked before submission: %s", spec.name, error)
        return
    if not found:
        return
    lines = yaml_lines(text) if text else {}
    problems = []
    for settings, error in found:
        problem = _problem(error, spec.job.name, 0, single_job=True)
        if settings:
            problem["loc"] = ["space", space_field(settings, error)]
            problem["settings"] = settings
            problem["msg"] = f"with {settings_text(settings)}: {problem['msg']}"
        else:
            problem["loc"] = ["job", *problem["loc"]]
        problem["field"] = ".".join(map(str, problem["loc"]))
        if lines.get(tuple(problem["loc"])) is not None:
            problem["line"] = lines[tuple(problem["loc"])]
        problems.append(problem)
    raise refusal(problems, True, [spec.job.name], then=_then(problems))


def _row_problems(submissions: list[JobSubmission], index_of: dict[str, int], single_job: bool) -> list[dict]:
    """The 422's entries for each submission's first bad row, read with its base model's tokenizer (a base whose
    tokenizer is not on this machine: its jobs' rows are left to their start)."""
    problems: list[dict[str, Any]] = []
    for base in dict.fromkeys(submission.base_model for submission in submissions):
        jobs = [submission.job for submission in submissions if submission.base_model == base]
        try:
            with TOKENIZERS.held(base) as tokenizer:   # loaded once per base; one thread uses it at a time
                found = data_row_problems(jobs, tokenizer)
        except TokenizerUnavailable as error:   # not on this machine: the rows are checked when the jobs start
            log.info("aspen http: rows of jobs on %s not checked before submission: %s", base, error)
            continue
        for job, error in found:
            problems.append(_problem(error, job.name, index_of[job.name], single_job))
    return problems


def _problem(error: Any, job: str, index: int, single_job: bool) -> dict[str, Any]:
    """The 422's entry for a job's `DataError`: located at the job's `eval_split` where that is what leaves nothing
    to train on, else at its `data`; `row` and `row_field`: the data file's row (as its message writes it) and the
    row's field, where the error names them."""
    name = "eval_split" if error.field == "eval_split" and error.line is None else "data"
    loc: list[Any] = [name] if single_job else ["jobs", index, name]
    entry: dict[str, Any] = {"loc": loc, "field": ".".join(map(str, loc)), "type": "data_row", "msg": str(error),
                             "job": job}
    if error.source is not None:
        entry["data"] = error.source
    if error.line is not None:
        entry["row"] = int(error.line)
    if isinstance(error, DataUnreadable):   # the dataset itself, not a row: what to fix instead
        entry.update(type="data_unreadable", fix=error.fix)
    elif error.field is not None and name == "data":
        entry["row_field"] = error.field
    return entry
