"""A submission to the HTTP API (`POST /v1/jobs`), from its body to the `JobSubmission`s the service takes,
checked with the same pydantic models as a jobs file, every problem with its location (`loc`) and message.

The body is JSON or YAML text (by its Content-Type), a mapping in one of two shapes:

- a jobs file: `{base_model, quantization, dtype, seed, output_dir, step_tokens, jobs: [...]}`: every job,
  all or none;
- one job's fields (`{name, data, format, ...}`), with the run-level `base_model`, `quantization`, `dtype`
  and `output_dir` beside them (as the Ray client's `submit(spec, base_model=..., output_dir=...)`:
  `output_dir` is then the job's own folder; in a jobs file it holds one folder per job).

Paths are the service's: `data` (and a `base_model` given as a path) must be absolute or a storage URI (a
relative one would be relative to wherever the API server happens to run); a relative `output_dir` is
taken under the service's output root. Without `output_dir`, each job gets the service's default folder
(`<output root>/<job id>`). Without `step_tokens`, the service checks each micro-batch against its trainers'
steps. Ray-free."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from actors.spec.saved_adapter import is_job_adapter
from actors.spec.trainer_settings import MAX_STEP_TOKENS
from actors.storage.storage_uri import as_location, is_uri
from orchestrator.jobs_file import SpecError, field_message, parse_run_spec
from orchestrator.spec_text import TextLimits, TooComplex, load_json, load_yaml

JSON_TYPES = ("application/json",)
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml", "text/plain")
RUN_FIELDS_BESIDE_A_JOB = ("base_model", "quantization", "dtype", "output_dir")   # `seed` is also a job field
# a body is job specs: 5 deep, about 25 values per job (30 000: some 1 200 jobs); no anchors or aliases (a few
# bytes of them can stand for a structure too large to walk); read within 2 s (libyaml checks 30 000 values in
# about 0.1 s)
BODY_LIMITS = TextLimits(depth=32, values=30_000, aliases=False, seconds=2.0)


@dataclass
class Refused(Exception):
    """A request refused before anything reached the service: HTTP `status`, a one-paragraph `detail` and,
    for a spec, one entry per problem (`loc`: the path of the field, `msg`, `type`)."""

    status: int
    detail: str
    errors: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        return self.detail


def parse_body(body: bytes, content_type: str | None, limits: TextLimits = BODY_LIMITS) -> tuple[Any, str | None]:
    """The body's data and, for YAML, its text (for line numbers); 415 for another media type, 413 for more
    values than `limits` allow, 422 for a body that is not valid JSON / YAML / UTF-8, nested too deeply, with
    YAML anchors or aliases, or not read within the time limit (each with its line and column where known).
    Slow only within its limits: call it off the server's event loop."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media not in JSON_TYPES + YAML_TYPES:
        raise Refused(415, f"a job submission is JSON (Content-Type: application/json) or YAML (Content-Type: "
                           f"application/yaml), not {media or 'a body without Content-Type'}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refused(422, f"the body is not UTF-8 text: {error}") from None
    if not text.strip():
        raise Refused(422, "the body is empty; send a job spec (its fields, or a jobs file with `jobs: [...]`)")
    try:
        if media in JSON_TYPES:
            return load_json(text, limits), None
        return load_yaml(text, limits), text
    except TooComplex as error:
        where = {key: value for key, value in (("line", error.line), ("column", error.column)) if value is not None}
        if error.kind == "too_many_values":
            raise Refused(413, f"the body holds {error}; submit the jobs in several requests",
                          [{"loc": ["body"], "msg": str(error), "type": error.kind, **where}]) from None
        detail = {"too_deep": f"the body is nested too deeply to be a job spec: {error}",
                  "too_slow": f"the body was {error}; send a smaller one"}.get(error.kind, str(error))
        raise Refused(422, detail, [{"loc": ["body"], "msg": str(error), "type": error.kind, **where}]) from None
    except json.JSONDecodeError as error:
        raise Refused(422, f"malformed JSON: {error.msg} at line {error.lineno}, column {error.colno}",
                      [{"loc": ["body"], "msg": f"malformed JSON: {error.msg}", "type": "json_invalid",
                        "line": error.lineno, "column": error.colno}]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
        where = {"line": mark.line + 1, "column": mark.column + 1} if mark is not None else {}
        problem = " ".join(part for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
        problem = problem or " ".join(str(error).split())
        at = f" at line {where['line']}, column {where['column']}" if where else ""
        raise Refused(422, f"malformed YAML: {problem}{at}",
                      [{"loc": ["body"], "msg": f"malformed YAML: {problem}", "type": "yaml_invalid", **where}]
                      ) from None


def _field_errors(error: ValidationError, single_job: bool) -> list[dict[str, Any]]:
    """pydantic's errors, each located as the request wrote it (one job: without the `jobs.0.` prefix)."""
    found = []
    for item in error.errors():
        loc = [part for i, part in enumerate(item["loc"])
               if not (i > 0 and item["loc"][i - 1] == "format" and isinstance(part, str) and part in
                       ("alpaca", "prompt_response", "chat", "text"))]
        if single_job and loc[:2] == ["jobs", 0]:
            loc = loc[2:]
        message = field_message(item, tuple(loc))   # an unknown field: RunSpec's loc (one job's made jobs[0]'s)
        found.append({"loc": loc, "field": ".".join(str(part) for part in loc) or "(top level)", "msg": message,
                      "type": item["type"]})
    return found


def _path_problems(data: dict, single_job: bool, output_root: str | None) -> list[dict[str, Any]]:
    """Paths the service cannot take from a remote submitter: relative data or base model paths, a relative
    output_dir where the service has no output root."""
    problems = []
    jobs = data.get("jobs") if isinstance(data.get("jobs"), list) else []
    for index, job in enumerate(jobs):
        for name in ("data", "init_adapter"):
            value = job.get(name) if isinstance(job, dict) else None
            if (isinstance(value, str) and value.strip() and not is_uri(value) and not is_job_adapter(value)
                    and not Path(value).expanduser().is_absolute()):
                loc = [name] if single_job else ["jobs", index, name]
                problems.append({"loc": loc, "field": ".".join(map(str, loc)), "type": "relative_path",
                                 "msg": f"relative path {value!r}: the service cannot tell what it is relative to; "
                                        "give an absolute path on the service's machine or a storage URI (s3://...)"})
    model = data.get("base_model")
    if isinstance(model, str) and model.startswith(".") and not Path(model).is_absolute():
        problems.append({"loc": ["base_model"], "field": "base_model", "type": "relative_path",
                         "msg": f"relative path {model!r}: give an absolute path on the service's machine, an alias "
                                "(smollm2-135m) or a hub id"})
    output = data.get("output_dir")
    if (isinstance(output, str) and output.strip() and not is_uri(output)
            and not Path(output).expanduser().is_absolute() and output_root is None):
        problems.append({"loc": ["output_dir"], "field": "output_dir", "type": "relative_path",
                         "msg": f"relative path {output!r}, and this service has no output root to take it under; "
                                "give an absolute path or leave output_dir out"})
    return problems


def _missing_files(run: RunSpec, single_job: bool) -> list[dict[str, Any]]:
    problems = []
    for index, job in enumerate(run.jobs):
        if not is_uri(job.data) and not Path(job.data).exists():   # a URI is read (and checked) when the job starts
            loc = ["data"] if single_job else ["jobs", index, "data"]
            problems.append({"loc": loc, "field": ".".join(map(str, loc)), "type": "file_missing",
                             "msg": f"file {job.data} does not exist on the service's machine"})
    return problems


def refusal(problems: list[dict[str, Any]], single_job: bool, names: list[Any], message: str | None = None, *,
            then: str = "") -> Refused:
    """422 naming each problem's job and field (`message`: the whole text instead; `then`: a last line, what to do)."""
    def where(problem: dict[str, Any]) -> str:
        loc = problem["loc"]
        if not single_job and len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int):
            name = names[loc[1]] if loc[1] < len(names) else None
            rest = ".".join(map(str, loc[2:])) or "(the job)"
            return f"job '{name}' (jobs[{loc[1]}]), field {rest}" if name else f"jobs[{loc[1]}], field {rest}"
        prefix = f"job '{names[0]}', " if single_job and names and names[0] else ""
        return f"{prefix}field {problem['field']}"

    detail = message or "\n".join(f"{where(p)}: {p['msg']}" for p in problems)
    return Refused(422, f"nothing was submitted:\n{detail}" + (f"\n{then}" if then else ""), problems)


def submissions_from(data: Any, *, text: str | None = None, output_root: str | None = None,
                     check_files: bool = True) -> list[JobSubmission]:
    """The request's jobs as the service takes them, or `Refused` (422) naming every problem's field.
    `check_files`: refuse data files that do not exist here (off for a user's request: the service checks
    the data roots first, so that whether a file outside them exists is not revealed)."""
    if not isinstance(data, dict):
        raise Refused(422, f"the body is a {type(data).__name__}; send a mapping: a job's fields, or a jobs file "
                           "with `jobs: [...]`", [{"loc": [], "field": "(top level)", "type": "model_type",
                                                   "msg": "expected a mapping"}])
    single_job = "jobs" not in data
    if single_job:
        run_fields = {key: data[key] for key in RUN_FIELDS_BESIDE_A_JOB if key in data}
        job = {key: value for key, value in data.items() if key not in RUN_FIELDS_BESIDE_A_JOB}
        data = {**run_fields, "jobs": [job]}
        text = None   # its lines are not a jobs file's
    else:
        data = dict(data)
    output_given = data.get("output_dir") is not None
    data.setdefault("step_tokens", MAX_STEP_TOKENS)   # the service checks against its trainers' steps
    jobs = data.get("jobs") if isinstance(data.get("jobs"), list) else []
    names = [job.get("name") if isinstance(job, dict) else None for job in jobs]
    problems = _path_problems(data, single_job, output_root)
    if problems:
        raise refusal(problems, single_job, names)
    try:
        run = parse_run_spec(data, source="request", text=text, check_files=False, for_a_service=True)
    except SpecError as error:
        problems = []
        try:
            RunSpec.model_validate(data)
        except ValidationError as validation:
            problems = _field_errors(validation, single_job)
        message = None if single_job else str(error)   # a jobs file's own message has its YAML line numbers
        raise refusal(problems, single_job, names, message) from None
    problems = _missing_files(run, single_job) if check_files else []
    if problems:
        raise refusal(problems, single_job, names)
    output_dir = as_location(str(data["output_dir"])) if output_given else None

    def folder(job: JobSpec) -> Any:
        if output_dir is None:
            return None
        return output_dir if single_job else output_dir / job.name

    return [JobSubmission(job=job, base_model=run.base_model, quantization=run.quantization, dtype=run.dtype,
                          seed=run.job_seed(job), output_dir=folder(job)) for job in run.jobs]


def as_request(spec: JobSpec | RunSpec | dict, **run_settings: Any) -> dict[str, Any]:
    """A body for `POST /v1/jobs`: a `RunSpec` or `JobSpec` as JSON data (only the fields that were set), or
    a dict as it is, with `run_settings` (base_model, quantization, dtype, output_dir) beside a job's fields."""
    if isinstance(spec, (RunSpec, JobSpec)):
        spec = spec.model_dump(mode="json", exclude_unset=True)
    body = dict(spec)
    for key, value in run_settings.items():
        if value is not None:
            body.setdefault(key, str(value) if isinstance(value, Path) else value)
    return body
