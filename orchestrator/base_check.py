"""A jobs file's base model checked before `aspen run` starts anything, each problem naming the file, line and field:
that the base exists (before an earlier run's jobs are compared with the file's: a typo'd base path is that, not a
changed spec), and that every job's `lora.target_modules` names linear layers the base has (read from its config,
the model built on `meta` in a process of its own: actors/engine/base_layers.py), rather than each job failing once
its trainer has loaded the base."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from actors.spec.run_spec import RunSpec
from orchestrator.jobs_file import SpecError, read_spec_text, yaml_lines

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 600   # a GGUF base is converted first, as its trainer would (minutes for a large one)


def _where(file: str | Path, lines: dict[tuple, int], path: tuple) -> str:
    """`file:line` of the nearest part of `path` the file names (a job's line where its lora is the default)."""
    line = next((lines[path[:end]] for end in range(len(path), -1, -1) if path[:end] in lines), None)
    return f"{file}:{line}" if line else str(file)


def check_base_exists(spec: RunSpec, file: str | Path) -> None:
    """A `SpecError` naming the file's line and field base_model where the base does not exist (a path that is not
    there, a hub id not in the local Hugging Face cache), with what to give instead."""
    from actors.storage.sources import resolve_source

    try:
        resolve_source(spec.base_model)
    except FileNotFoundError as error:
        lines = yaml_lines(read_spec_text(Path(file)))
        message = str(error).removeprefix("base_model: ")
        raise SpecError(f"{_where(file, lines, ('base_model',))}: base_model: {message}\n(nothing was started: fix "
                        "base_model, then run again)") from None


def check_target_modules(spec: RunSpec, file: str | Path) -> None:
    """A `SpecError` naming, for each job's `lora.target_modules` entry that matches no linear layer of the base (or
    names one its model type leaves alone), the file's line, the job, the name and the base's layer names (the
    nearest one first). A base whose config cannot be read or built is left to its trainer, which says why."""
    named = [(index, job) for index, job in enumerate(spec.jobs) if isinstance(job.lora.target_modules, list)
             and job.lora.target_modules]
    if not named:
        return
    found = _target_problems(spec.base_model, [t for _, job in named for t in job.lora.target_modules])
    if found is None:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    problems: list[str] = []
    for index, job in named:
        for position, target in enumerate(job.lora.target_modules):
            if found.get(target) is not None:
                where = _where(file, lines, ("jobs", index, "lora", "target_modules", position))
                problems.append(f"{where}: job '{job.name}' (jobs[{index}]), field lora.target_modules: "
                                f"{str(found[target]).removeprefix('lora.target_modules: ')}")
    if problems:
        raise SpecError("\n".join(problems) + f"\n(nothing was started: fix the names for base {spec.base_model}, "
                        "then run again)")


def _target_problems(base_model: str, targets: list[str]) -> dict[str, str | None] | None:
    """Each target's problem on the base (actors/engine/base_layers.py), found in a process of its own: this one (the
    run's driver) imports no torch and keeps no model. None where the base's config cannot be read or built there
    (logged): its trainer's load then says what is wrong with the base."""
    try:
        done = subprocess.run([sys.executable, "-m", "actors.engine.base_layers", base_model, json.dumps(targets)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.info("lora.target_modules not checked before the run starts: reading %s's config took over %d s",
                 base_model, CHECK_TIMEOUT_S)
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        log.info("lora.target_modules not checked before the run starts (the base's config: %s)", why)
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:   # something else printed last: the trainer checks the names as it starts
        log.info("lora.target_modules not checked before the run starts (its check printed %r)", lines[-1][:200])
        return None
