"""The folders `aspen run` writes, checked before anything starts: each job's own folder under the run's output_dir
(not a file in its place). A problem with them is not the jobs file's: `RunFolderError` is said as what it is."""

from __future__ import annotations

from pathlib import Path

from actors.spec.run_spec import RunSpec
from actors.storage.storage_uri import is_uri
from orchestrator.jobs_file import read_spec_text, yaml_lines


class RunFolderError(ValueError):
    """A folder the run would write that cannot be one, with its path and what to do (exit 2)."""


def check_job_folders(spec: RunSpec, file: str | Path) -> None:
    """`RunFolderError` naming each job whose folder (`output_dir/<job name>`) is a file: its path, the job's line in
    the jobs file and what to do, rather than the job failing as it starts (its trainer cannot make the folder)."""
    if is_uri(spec.output_dir):
        return
    taken = [(index, job.name) for index, job in enumerate(spec.jobs)
             if (Path(spec.output_dir) / job.name).exists() and not (Path(spec.output_dir) / job.name).is_dir()]
    if not taken:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    problems = []
    for index, name in taken:
        line = lines.get(("jobs", index, "name"))
        where = f"{file}:{line}: " if line else f"{file}: "
        problems.append(f"{where}job '{name}' (jobs[{index}]): a file is in the way of its folder: "
                        f"{Path(spec.output_dir) / name} is a file, where the run keeps the job's adapter, checkpoints "
                        "and metrics")
    raise RunFolderError("\n".join(problems) + "\n(nothing was started: move or delete the file, or rename the job, "
                         "or give the run another output_dir)")
