"""What the Python client (orchestrator/client.py) submits for a job spec or a jobs file: a spec validated as the
service takes it (`as_submission`), and a jobs file's or `RunSpec`'s jobs with their output folders
(`run_submissions`), alike for `Client.submit(path)` with a one-job file (`one_job_file`) and `Client.submit_run`:
the file's relative paths (data, init_adapter, functions, output_dir) taken from the file's folder, as `aspen run`
and `aspen submit` take them (docs/spec.md), a relative output_dir under a shared service's output root instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.data.locations import hub_id_problem
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.run_spec import RunSpec
from actors.storage.storage_uri import is_uri, resolve_location
from orchestrator.jobs_file import (
    SpecError,
    load_run_spec,
    output_dir_for_service,
    parse_run_spec,
    relative_output_dir,
)


def as_submission(spec: JobSpec | JobSubmission | dict, *, base_model: str = "smollm2-135m",
                  quantization: str = "none", dtype: str = "auto", seed: int = 0,
                  output_dir: str | Path | None = None) -> JobSubmission:
    """A job spec (a dict of job fields, a `JobSpec` or a `JobSubmission`) as the service takes it, validated
    here: a bad spec raises `SpecError` naming the field (a dict's paths relative to this process's folder)."""
    if isinstance(spec, JobSubmission):
        return spec
    if isinstance(spec, dict):
        # the service checks the micro-batch against its trainers' steps; here only the spec's own values
        run = parse_run_spec({"base_model": base_model, "quantization": quantization, "dtype": dtype,
                              "seed": seed, "jobs": [spec]}, source="<job>", base_dir=Path.cwd(),
                             for_a_service=True)
        spec = run.jobs[0]
    if not isinstance(spec, JobSpec):
        raise SpecError(f"expected a JobSpec, a JobSubmission or a dict of job fields, got {type(spec).__name__}")
    if not is_uri(spec.data) and not spec.data.exists():   # a URI is read when the job starts
        problem = hub_id_problem(str(spec.data)) or f"file {spec.data} does not exist"
        raise SpecError(f"job '{spec.name}', field data: {problem}")
    try:
        return JobSubmission(job=spec, base_model=base_model, quantization=quantization, dtype=dtype,
                             seed=spec.seed if spec.seed is not None else seed,
                             output_dir=resolve_location(output_dir) if output_dir else None)
    except ValueError as error:
        raise SpecError(f"job '{spec.name}': {error}") from None


def file_folder(path: str | Path) -> Path:
    """The folder a jobs file's relative paths are taken from: its own."""
    return Path(path).expanduser().resolve().parent


def one_job_file(path: str | Path) -> RunSpec:
    """A jobs file of one job (`Client.submit`), validated for a running service; a `SpecError` for several."""
    run = load_run_spec(path, for_a_service=True)
    if len(run.jobs) != 1:
        raise SpecError(f"{path}: has {len(run.jobs)} jobs; submit it with submit_run() (or `aspen submit`) to "
                        "get one handle per job")
    return run


def run_submissions(run: RunSpec, folder: Path, output_root: Callable[[], Any]) -> list[JobSubmission]:
    """The run's jobs as the service takes them: each writes to `<output_dir>/<job name>`, a relative output_dir
    under the service's output root (`output_root()`: the service's, asked only for a relative one), or where the
    service has none from `folder` (the jobs file's), as `aspen run` takes it; where the run names no output_dir,
    where the service puts a job without one (`<output_root>/<job id>`)."""
    if "output_dir" not in run.model_fields_set:
        return [submission.model_copy(update={"output_dir": None}) for submission in run.submissions()]
    if relative_output_dir(run) and output_root():   # under the root, as over HTTP
        return run.submissions()
    run = output_dir_for_service(run, folder, has_output_root=False)   # Client.local: the file's folder
    return run.model_copy(update={"output_dir": resolve_location(run.output_dir)}).submissions()
