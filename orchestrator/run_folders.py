"""The folders `aspen run` writes, checked before anything starts: the run's output_dir (a folder this process can
write) and each job's own folder under it (not a file in its place). A problem that is not the jobs file's (a bad
--output-dir, a file in a job folder's place) is a `RunFolderError`, said as what it is."""

from __future__ import annotations

import tempfile
from pathlib import Path

from actors.spec.run_spec import RunSpec
from actors.storage.storage_uri import is_uri
from orchestrator.jobs_file import SpecError, read_spec_text, yaml_lines


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


def check_output_dir(spec: RunSpec, file: str | Path, *, overridden: bool = False) -> None:
    """Whether a run's output_dir (a local one) can be a folder this process writes, before anything starts (a run
    writes its job table there first), creating nothing (a run refused later leaves no folder behind): a `SpecError`
    naming the file's line (a `RunFolderError` naming --output-dir, where `overridden`: not the file's), the folder
    and why where it cannot be (a file in its place, a path under a file, a read-only or missing mount)."""
    if is_uri(spec.output_dir):
        return
    folder = Path(spec.output_dir)
    try:
        existing = folder
        while not existing.exists():   # the nearest part of it that exists: the run creates the rest
            existing = existing.parent
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file, not a folder")
        with tempfile.TemporaryFile(dir=existing):   # a file there, nameless and gone when closed
            pass
    except OSError as error:
        why = error.strerror or str(error) if error.filename else str(error)
        if overridden:   # the command line's, not the jobs file's
            raise RunFolderError(f"--output-dir: the run's folder {folder} cannot be created or written ({why}); "
                                 "give --output-dir a folder you can write (or leave it out: the file's output_dir)"
                                 ) from None
        line = yaml_lines(read_spec_text(Path(file))).get(("output_dir",))
        where = f"{file}:{line}: output_dir" if line else f"{file}: output_dir"
        raise SpecError(f"{where}: the run's folder {folder} cannot be created or written ({why}); give a folder "
                        "you can write, in the file's output_dir or with --output-dir") from None
