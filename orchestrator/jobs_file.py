"""Reading `jobs.yaml` into a validated `RunSpec`, with errors that name the file, line, job and field."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from actors.data.locations import hub_id_problem
from actors.spec.field_types import PATTERN_WORDS
from actors.spec.job_chains import chain_problem
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from actors.spec.run_spec import FOR_A_SERVICE, RunSpec
from actors.spec.saved_adapter import AdapterFileError, JobAdapter, check_adapter_config, is_job_adapter
from actors.spec.user_functions import functions_resolved
from actors.storage.storage_uri import is_uri
from orchestrator.spec_text import TextLimits, TooComplex, compose_yaml, load_yaml

__all__ = ["JobSpec", "LoraConfig", "RunSpec", "SpecError", "load_run_spec", "parse_run_spec"]

# a jobs file is the user's own: anchors and aliases are welcome (`<<: *defaults`), but neither they nor its
# nesting may stand for more than a jobs file could hold (a "billion laughs" file is refused in milliseconds)
FILE_LIMITS = TextLimits(depth=32, values=1_000_000, aliases=True)


class SpecError(ValueError):
    """A jobs file or job spec that cannot be used, with every problem listed."""


def yaml_lines(text: str) -> dict[tuple, int]:
    """1-based line of every mapping key and sequence item, by path, e.g. ('jobs', 0, 'lora', 'r')."""
    lines: dict[tuple, int] = {}

    def walk(node: yaml.Node, path: tuple) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = path + (key.value,)
                lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                walk(item, path + (index,))

    try:
        root = compose_yaml(text)   # libyaml, within the limits the text was read with
    except (yaml.YAMLError, TooComplex):
        return lines
    if root is not None:
        walk(root, ())
    return lines


_FORMAT_TAGS = {"alpaca", "prompt_response", "chat", "text"}
USER_FUNCTIONS = (("grpo", "reward"), ("eval_generate", "metric"))
"""The spec fields that may name a function of the user's (actors/spec/user_functions.py)."""


def _drop_union_tags(loc: tuple) -> tuple:
    """pydantic puts the chosen union member's tag in the path (format.prompt_response.response)."""
    return tuple(part for i, part in enumerate(loc)
                 if not (i > 0 and loc[i - 1] == "format" and part in _FORMAT_TAGS))


SPEC_DOC = "docs/spec.md"


def _model_at(model: Any, loc: tuple) -> Any:
    """The pydantic model whose field the last part of `loc` names (walking lists by index and a tagged union by
    its tag: format.prompt_response.prompt), or None."""
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or not hasattr(model, "model_fields"):
            return None
        if part not in model.model_fields:
            members = _union_members(model)
            model = members.get(part)
            continue
        model = _inner_model(model.model_fields[part].annotation)
    return model


def _inner_model(annotation: Any) -> Any:
    """The model (or the tagged union of models) a field holds, through list[...], X | None and Annotated."""
    if hasattr(annotation, "model_fields"):
        return annotation
    for argument in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(argument)
        if found is not None:
            return _TaggedUnion(annotation) if _is_union_of_models(annotation) else found
    origin = getattr(annotation, "__origin__", None)
    return _inner_model(origin) if origin is not None and origin is not annotation else None


def _is_union_of_models(annotation: Any) -> bool:
    return sum(hasattr(argument, "model_fields") for argument in getattr(annotation, "__args__", ()) or ()) > 1


class _TaggedUnion:
    """A field holding one of several models told apart by their `type` (a job's `format`)."""

    model_fields: dict = {}

    def __init__(self, annotation: Any):
        self.annotation = annotation


def _union_members(model: Any) -> dict[str, Any]:
    if not isinstance(model, _TaggedUnion):
        return {}
    members = {}
    for argument in _flat_args(model.annotation):
        if hasattr(argument, "model_fields") and "type" in argument.model_fields:
            tag = argument.model_fields["type"].default
            members[str(tag)] = argument
    return members


def _flat_args(annotation: Any) -> list[Any]:
    out = []
    for argument in getattr(annotation, "__args__", ()) or ():
        out.extend([argument] if hasattr(argument, "model_fields") else _flat_args(argument))
    return out


def _suggestion(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.6)
    if not close:   # a prefix or a part of a field (rank -> r, max_step -> max_steps)
        close = [c for c in choices if c.startswith(word) or word.startswith(c) and len(c) > 1][:2]
    return f"; did you mean {' or '.join(f'`{c}`' for c in close)}?" if close else ""


def unknown_field(loc: tuple) -> str:
    """An unknown field's message: the close fields of the same place, and where they are all listed."""
    model = _model_at(RunSpec, loc[:-1])
    field = str(loc[-1])
    fields = sorted(model.model_fields) if model is not None and hasattr(model, "model_fields") else []
    known = {"rank": "r", "alpha": "alpha", "dropout": "dropout", "steps": "max_steps", "learning_rate": "lr"}
    hint = (f"; did you mean `{known[field]}`?" if known.get(field) in fields else _suggestion(field, fields))
    return f"unknown field{hint} ({SPEC_DOC} lists every field with its default and range)"


def unknown_tag(context: dict, loc: tuple) -> str:
    tag = str(context.get("tag"))
    expected = [t.strip().strip("'") for t in str(context.get("expected_tags", "")).split(",") if t.strip()]
    field = str(loc[-1]) if loc else "type"
    return (f"{field} type '{tag}' is not one of {', '.join(expected)}{_suggestion(tag, expected)} "
            f"({SPEC_DOC} lists each one's fields)")


def field_message(item: Any, loc: tuple) -> str:
    """One of pydantic's errors as a user reads it: a validator's own message without pydantic's prefix, an
    unknown field or format type with the names meant, a name pattern in words. `loc`: where it is, union tags
    dropped."""
    message = item["msg"].removeprefix("Value error, ")   # a validator's own message: pydantic prefixes it
    if item["type"] == "extra_forbidden":
        return unknown_field(tuple(item["loc"]))
    if item["type"] == "union_tag_invalid":
        return unknown_tag(item.get("ctx") or {}, loc)
    if item["type"] == "string_pattern_mismatch" and (item.get("ctx") or {}).get("pattern") in PATTERN_WORDS:
        return f"{item['input']!r} is not a name aspen takes: {PATTERN_WORDS[item['ctx']['pattern']]}"
    return message


def _describe(error: ValidationError, data: Any, source: str, lines: dict[tuple, int]) -> str:
    problems = []
    for item in error.errors():
        loc = _drop_union_tags(tuple(item["loc"]))
        where = ".".join(str(p) for p in loc) or "(top level)"
        if len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int):
            jobs = data.get("jobs") if isinstance(data, dict) else None
            name = jobs[loc[1]].get("name") if isinstance(jobs, list) and loc[1] < len(jobs) and isinstance(
                jobs[loc[1]], dict) else None
            field = ".".join(str(p) for p in loc[2:]) or "(the job)"
            where = f"job '{name}' (jobs[{loc[1]}]), field {field}" if name else f"jobs[{loc[1]}], field {field}"
        line = None
        for cut in range(len(loc), -1, -1):
            if loc[:cut] in lines:
                line = lines[loc[:cut]]
                break
        message = field_message(item, loc)
        prefix = f"{source}:{line}: " if line else f"{source}: "
        problems.append(f"{prefix}{where}: {message}")
    return "\n".join(problems)


def tidy_path(path: str | Path) -> str:
    """`path` without `.` and `name/..` parts where that names the same file (not where a `name` is a link
    elsewhere, whose `..` is the link target's parent): what messages and the job table show."""
    text = str(path)
    tidy = os.path.normpath(text)
    return tidy if tidy == text or os.path.realpath(tidy) == os.path.realpath(text) else text


def _resolve_paths(data: dict, base_dir: Path, for_a_service: bool) -> None:
    """The file's relative paths taken from its folder; but for a file submitted to a running service, a relative
    output_dir stays relative: the service takes it under its output root (as its HTTP API takes one)."""
    for job in data["jobs"] if isinstance(data.get("jobs"), list) else []:
        if isinstance(job, dict) and isinstance(job.get("data"), str) and not is_uri(job["data"]):
            path = Path(job["data"]).expanduser()
            if not path.is_absolute() and hub_id_problem(job["data"]) and not (base_dir / path).exists():
                continue   # a hub id, refused by name when the files are checked
            job["data"] = tidy_path(path if path.is_absolute() else base_dir / path)
        adapter = job.get("init_adapter") if isinstance(job, dict) else None
        if isinstance(adapter, str) and not is_uri(adapter) and not is_job_adapter(adapter):
            path = Path(job["init_adapter"]).expanduser()
            job["init_adapter"] = tidy_path(path if path.is_absolute() else base_dir / path)
        for section, key in USER_FUNCTIONS:   # a function's file (file.py:function), as the data: from the file
            inner = job.get(section) if isinstance(job, dict) else None
            if isinstance(inner, dict) and key in inner:
                job[section] = {**inner, key: functions_resolved(inner[key], base_dir)}
    model = data.get("base_model")
    if isinstance(model, str) and model.startswith((".", "/", "~")) and not Path(model).expanduser().is_absolute():
        data["base_model"] = tidy_path(base_dir / model)
    output = data.get("output_dir")
    if (isinstance(output, str) and not is_uri(output) and not Path(output).expanduser().is_absolute()
            and not for_a_service):
        data["output_dir"] = tidy_path(base_dir / output)


def function_load_problems(references: list[tuple[str, str]]) -> list[str | None]:
    """Why each (field, reference) function cannot be loaded, loaded in a process of its own (user_calls.py)."""
    if not references:
        return []
    from actors.engine.user_calls import load_problems  # a worker process: only for a file that names functions

    return load_problems(references)


def adapter_problem(spec: RunSpec, index: int) -> str | None:
    """Why job `index`'s init_adapter cannot be (None: it can): a folder whose config does not fit its lora (a
    storage URI's is read when the job starts), or a `job:<name>` that names no other job of the file, is part of a
    cycle, or ends with an adapter of another shape."""
    job = spec.jobs[index]
    if job.init_adapter is None or is_uri(job.init_adapter):
        return None
    if not isinstance(job.init_adapter, JobAdapter):
        try:
            check_adapter_config(job.init_adapter, job.lora)
        except AdapterFileError as error:
            return str(error)
        return None
    return chain_problem(job, {other.name: other for other in spec.jobs})


def _check_files(spec: RunSpec, source: str, lines: dict[tuple, int]) -> None:
    missing = []
    for index, job in enumerate(spec.jobs):
        if not is_uri(job.data) and not job.data.exists():   # a URI is read (and checked) when the job starts
            line = lines.get(("jobs", index, "data"))
            prefix = f"{source}:{line}: " if line else f"{source}: "
            problem = hub_id_problem(str(job.data)) or f"file {job.data} does not exist"
            missing.append(f"{prefix}job '{job.name}' (jobs[{index}]), field data: {problem}")
        problem = adapter_problem(spec, index)
        if problem is not None:
            line = lines.get(("jobs", index, "init_adapter"))
            prefix = f"{source}:{line}: " if line else f"{source}: "
            missing.append(f"{prefix}job '{job.name}' (jobs[{index}]), field {problem}")
        functions = job.user_functions()   # a function of the user's loads now, not first on a trainer
        for (field, _), error in zip(functions, function_load_problems(functions), strict=True):
            if error is not None:
                path = tuple(int(part) if part.isdigit() else part for part in field.split("."))
                line = next((lines[("jobs", index, *path[:end])] for end in range(len(path), 0, -1)
                             if ("jobs", index, *path[:end]) in lines), None)
                prefix = f"{source}:{line}: " if line else f"{source}: "
                problem = error.removeprefix(f"{field} ")
                missing.append(f"{prefix}job '{job.name}' (jobs[{index}]), field {field}: {problem}")
    if missing:
        raise SpecError("\n".join(missing))


def parse_run_spec(data: Any, *, source: str = "<spec>", base_dir: Path | None = None,
                   text: str | None = None, check_files: bool = True, for_a_service: bool = False) -> RunSpec:
    """Validate a run spec given as a dict; relative paths are taken from `base_dir`. `for_a_service`: its jobs
    are submitted to a running service, whose trainers' steps (not the file's `step_tokens`) bound a micro-batch,
    and which takes a relative output_dir under its output root."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping with base_model, jobs, ... at the top level")
    data = dict(data)
    if isinstance(data.get("jobs"), list):   # each job copied (its paths are resolved in place); else RunSpec says
        data["jobs"] = [dict(job) if isinstance(job, dict) else job for job in data["jobs"]]
    lines = yaml_lines(text) if text else {}
    if base_dir is not None:
        _resolve_paths(data, base_dir, for_a_service)
    try:
        spec = RunSpec.model_validate(data, context={FOR_A_SERVICE: for_a_service})
    except ValidationError as error:
        raise SpecError(_describe(error, data, source, lines)) from None
    if check_files:
        _check_files(spec, source, lines)
    return spec


def relative_output_dir(run: RunSpec) -> bool:
    """Whether the run names an output_dir relative to nothing yet (`aspen submit` sends it as it is)."""
    output = str(run.output_dir)
    return "output_dir" in run.model_fields_set and not is_uri(output) and not Path(output).expanduser().is_absolute()


def output_dir_for_service(run: RunSpec, folder: Path, has_output_root: bool) -> RunSpec:
    """A run submitted to a running service: a relative output_dir stays relative where the service has an output
    root (it takes it under the root), and is taken from `folder` (the jobs file's) where it has none, as `aspen run`
    takes it."""
    if relative_output_dir(run) and not has_output_root:
        return run.model_copy(update={"output_dir": Path(folder) / run.output_dir})
    return run


def read_spec_text(path: Path) -> str:
    """A jobs or sweep file's text (UTF-8, a byte-order mark allowed); a SpecError naming the line and column of
    a byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        before = data[:error.start]
        line, column = before.count(b"\n") + 1, error.start - (before.rfind(b"\n") + 1) + 1
        raise SpecError(f"{path}:{line}: byte 0x{data[error.start]:02x} at column {column} is not UTF-8 (the file "
                        "was saved in another encoding, e.g. Latin-1); save it as UTF-8") from None


def load_run_spec(path: str | Path, *, check_files: bool = True, for_a_service: bool = False) -> RunSpec:
    """Read and validate a jobs YAML file; data paths are relative to the file's folder."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    text = read_spec_text(path)
    try:
        data = load_yaml(text, FILE_LIMITS)
    except TooComplex as error:
        where = f"{path}:{error.line}: " if error.line else f"{path}: "
        raise SpecError(where + error.reason) from None
    except yaml.YAMLError as error:
        raise SpecError(f"{path}: not valid YAML: {error}") from None
    return parse_run_spec(data, source=str(path), base_dir=path.parent.resolve(), text=text,
                          check_files=check_files, for_a_service=for_a_service)


def check_data_rows(spec: RunSpec, names: set[str] | None = None, *, source: str | None = None,
                    file: str | Path | None = None) -> None:
    """Every row of the jobs' data (the first rows of a remote or streamed dataset) read and tokenized as its job
    will read them (actors/data/row_check.py), before anything starts: a `SpecError` listing each job's
    first bad row, file:line and field, as the job itself would have failed on it; a dataset that cannot be found or
    read at all (`DataUnreadable`: a missing object, refused credentials) at its job's `data` line of `file` (the
    jobs file), with its own fix. `names`: only these jobs (those about to train; `source`: the file they are from,
    named first). Reads the base model's tokenizer (not its weights)."""
    from actors.storage.sources import load_base_tokenizer

    jobs = [job for job in spec.jobs if names is None or job.name in names]
    if not jobs:
        return
    problems = data_row_problems(jobs, load_base_tokenizer(spec.base_model))
    if problems:
        lines = yaml_lines(read_spec_text(Path(file))) if file is not None else {}
        indexes = {job.name: index for index, job in enumerate(spec.jobs)}
        raise SpecError((f"{source}: a row of its data does not fit its job's format\n" if source else "")
                        + "\n".join(data_problem_line(job, error, file, lines.get(("jobs", indexes[job.name], "data")))
                                     for job, error in problems)
                        + "\n" + data_problems_advice([error for _, error in problems]))


def data_problem_line(job: JobSpec, error: Any, file: str | Path | None = None, line: int | None = None) -> str:
    """One job's data problem: a bad row as 'job NAME: ERROR'; a dataset that cannot be read at all (`DataUnreadable`)
    at its job's `data` field, the jobs file's line first where known ('jobs.yaml:5: job NAME, field data: ERROR')."""
    from actors.data.rows import DataUnreadable

    if not isinstance(error, DataUnreadable):
        return f"job '{job.name}': {error}"
    where = "" if file is None else f"{file}:{line}: " if line else f"{file}: "
    return f"{where}job '{job.name}', field data: {error}"


def data_problems_advice(errors: list[Any]) -> str:
    """The closing line of a refusal for these `DataError`s: what to fix for each kind of cause (the rows or the
    format for a bad row; the URI, the credentials... for a dataset that cannot be read at all)."""
    from actors.data.rows import DataUnreadable

    fixes = dict.fromkeys(f"{error.fix} of the job's data" if isinstance(error, DataUnreadable)
                          else "the rows or the format" for error in errors)
    return f"(nothing was started: fix {' and '.join(fixes)}, then run again)"


def data_row_problems(jobs: list[JobSpec], tokenizer: Any) -> list[tuple[JobSpec, Any]]:
    """Each job's first bad row as the `DataError` its job would fail with (`check_job_rows`: a local file read
    whole, the first rows of a remote or streamed dataset), the checks `aspen run` / `aspen submit` and the HTTP
    API's submissions make; [] where every job's rows fit its format."""
    from actors.data.row_check import check_job_rows
    from actors.data.rows import DataError
    from actors.storage.storage_errors import StorageUnreachable

    problems = []
    for job in jobs:
        try:
            check_job_rows(job, tokenizer)
        except DataError as error:
            problems.append((job, error))
        except StorageUnreachable as error:   # not the data's fault (exit 1, not 2), but whose data it is is said
            raise StorageUnreachable(f"job '{job.name}': {error}") from error
    return problems
