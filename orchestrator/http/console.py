"""The web console's part of the HTTP server: its static files (orchestrator/console/static: HTML, JS
modules, CSS and the vendored chart library, all shipped in the package, nothing fetched from elsewhere)
served at `/`, and what its pages need beyond the job endpoints: a job's spec as a jobs file to clone
(`GET /v1/jobs/{job}/spec`), "try it" (`POST /v1/jobs/{job}/generate`) and the lines that serve or load its
adapter on the service's machine (`GET /v1/jobs/{job}/serving`). docs/console.md shows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from actors.spec.job_submission import JobSubmission

STATIC_DIR = Path(__file__).resolve().parents[1] / "console" / "static"
def jobs_file_of(submission: JobSubmission) -> dict[str, Any]:
    """A jobs file that submits the job again (its output folder left to the service: a clone writes its own)."""
    job = submission.job.model_dump(mode="json", exclude_defaults=True)
    job.setdefault("name", submission.job.name)
    # the format's `type` picks its kind (a discriminator): kept where it is the default, or the file reads
    # back as no format at all
    if submission.job.format is not None:   # none: an interactive model's (its data are its user's calls)
        job["format"] = {"type": submission.job.format.type, **job.get("format", {})}
    return {"base_model": submission.base_model, "quantization": submission.quantization, "dtype": submission.dtype,
            "seed": submission.seed, "jobs": [job]}


class _JobsFileDumper(yaml.SafeDumper):
    """YAML as a person writes a jobs file: text with line breaks as a literal block (`|`), each line as
    typed, not a quoted string folded at an arbitrary width; a whole-number float (a count of rows
    such as eval_split: 16) as an integer."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value and all(line == line.rstrip() for line in value.split("\n")):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


def _number(dumper: yaml.SafeDumper, value: float) -> yaml.ScalarNode:
    if value.is_integer() and abs(value) >= 1:
        return dumper.represent_int(int(value))
    return dumper.represent_float(value)


_JobsFileDumper.add_representer(str, _text)
_JobsFileDumper.add_representer(float, _number)


def jobs_file_yaml(data: dict[str, Any]) -> str:
    return yaml.dump(data, Dumper=_JobsFileDumper, sort_keys=False, allow_unicode=True, width=120)


def spec_answer(submission: JobSubmission) -> dict[str, Any]:
    data = jobs_file_of(submission)
    return {"yaml": jobs_file_yaml(data), "jobs_file": data}


def mount_console(app: FastAPI) -> None:
    """The console's files at `/` (index.html there); mounted last, so that /v1, /docs and /openapi.json win."""
    if not (STATIC_DIR / "index.html").is_file():
        raise FileNotFoundError(f"the web console's files are missing from {STATIC_DIR}; reinstall aspen-lora")
    app.mount("/", StaticFiles(directory=STATIC_DIR, html=True), name="console")


def serving_answer(record: Any, submission: JobSubmission) -> dict[str, Any]:
    """The vLLM and PEFT lines for a job's adapter as they run on this machine (actors/checkpoint/serving_lines):
    from its exported folder where it has one, else from its base and the folder its adapter will be
    written to. Raises OSError / ValueError where this machine cannot find the base."""
    from actors.checkpoint.serving_lines import adapter_serving_lines, serving_lines, vllm_cannot_serve
    from actors.storage.base_identity import base_identity
    from actors.storage.sources import resolve_source

    name = record.name.replace("/", "-")
    if record.adapter_dir and (Path(record.adapter_dir) / "adapter_config.json").is_file():
        lines = adapter_serving_lines(Path(record.adapter_dir), name)
    else:
        source = resolve_source(record.base_model)
        identity = base_identity(record.base_model, source)
        lora = submission.job.lora
        config = {"peft_type": "VERA" if lora.kind == "vera" else "LORA", "use_dora": lora.use_dora}
        lines = serving_lines(source, identity.serving_id, Path(record.output_dir).resolve(), name, lora.r,
                              vllm_cannot_serve(config))
    return {**lines.as_dict(), "written": bool(record.adapter_dir)}
