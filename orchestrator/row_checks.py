"""Data rows checked before jobs or a sweep are entered, in the submitting process: the Ray client
(`Client.submit`, `submit_run`, `submit_many`, `sweep`) and `aspen sweep` read and tokenize each job's rows as the
HTTP API does (orchestrator/http/data_rows.py) and `aspen submit` (orchestrator/jobs_file.py:check_data_rows),
refusing a row that does not fit its job's format with a `SpecError` naming the job, the data file's row and field,
before anything is entered; a dataset under a storage URI (s3://...) is read here too, its first rows, as over HTTP,
and one that cannot be read at all (`DataUnreadable`: no such object or bucket, no credentials) is refused at its
job's `data` line of the jobs file the jobs came from. A sweep's rows are read for every distinct combination of the
space's values that changes how they read (`SweepSpec.row_jobs`: a `max_seq_len` shorter than the prompts, an
`eval_split` that takes every row), each problem naming the space field and its value. Where this process has no
tokenizer of a base model (a base only the service's machines hold), its jobs' rows are left to their start, as
over HTTP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from actors.spec.job_submission import JobSubmission
from actors.spec.sweep_spec import SweepSpec
from orchestrator.http.base_tokenizers import TOKENIZERS, TokenizerUnavailable
from orchestrator.jobs_file import (
    SpecError,
    data_problem_line,
    data_problems_advice,
    data_row_problems,
    read_spec_text,
    yaml_lines,
)

log = logging.getLogger(__name__)


def check_submission_rows(submissions: list[JobSubmission], file: str | Path | None = None) -> None:
    """`SpecError` listing each job's first row that does not fit its format (as `check_data_rows` words it);
    `file`: the jobs file the submissions are, in its order (a dataset that cannot be read at all is then named at
    its job's `data` line, 'jobs.yaml:5: job NAME, field data: ...')."""
    problems = []
    for base in dict.fromkeys(submission.base_model for submission in submissions):
        jobs = [submission.job for submission in submissions if submission.base_model == base]
        try:
            with TOKENIZERS.held(base) as tokenizer:
                problems += data_row_problems(jobs, tokenizer)
        except TokenizerUnavailable as error:
            log.info("aspen: rows of jobs on %s not checked before submission: %s", base, error)
    if problems:
        lines = yaml_lines(read_spec_text(Path(file))) if file is not None else {}
        index = {submission.job.name: number for number, submission in enumerate(submissions)}
        raise SpecError("\n".join(data_problem_line(job, error, file, lines.get(("jobs", index[job.name], "data")))
                                  for job, error in problems)
                        + "\n" + data_problems_advice([error for _, error in problems]))


def sweep_row_problems(spec: SweepSpec, tokenizer: Any) -> list[tuple[dict[str, Any], Any]]:
    """Each `row_jobs` combination whose rows do not fit, with its settings ({}: the sweep's own job) and the
    `DataError` its trials would fail with."""
    return [(settings, error) for settings, job in spec.row_jobs()
            for _, error in data_row_problems([job], tokenizer)]


def space_field(settings: dict[str, Any], error: Any) -> str:
    """The space path a combination's problem is located at: an `eval_split` of the space where that is what leaves
    nothing to train on, else the first other path of the combination."""
    if error.field == "eval_split" and error.line is None and "eval_split" in settings:
        return "eval_split"
    return next((path for path in settings if path != "eval_split"), next(iter(settings)))


def settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{path}={value!r}" for path, value in settings.items())


def check_sweep_data_rows(spec: SweepSpec, source: str | None = None) -> None:
    """`SpecError` naming each combination of the sweep's settings whose rows do not fit (its space field and
    value, the data file's row and field), `source` (the sweep file) first."""
    try:
        with TOKENIZERS.held(spec.base_model) as tokenizer:
            problems = sweep_row_problems(spec, tokenizer)
    except TokenizerUnavailable as error:
        log.info("aspen: rows of sweep %s not checked before submission: %s", spec.name, error)
        return
    if not problems:
        return
    lines = [f"job '{spec.job.name}'" + (f" with space.{space_field(settings, error)} "
                                         f"({settings_text(settings)})" if settings else "") + f": {error}"
             for settings, error in problems]
    raise SpecError((f"{source}: a row of its data does not fit its job's format\n" if source else "")
                    + "\n".join(lines) + "\n" + data_problems_advice([error for _, error in problems]))
