"""A jobs file's base model checked before `aspen run` starts anything, each problem naming the file, line and field:
that the base exists (before an earlier run's jobs are compared with the file's: a typo'd base path is that, not a
changed spec), and that every job's `lora.target_modules` names linear layers the base has (orchestrator/
target_layers.py), rather than each job failing once its trainer has loaded the base; the same names checked for
`aspen submit`, and for a sweep file's job and space (`aspen sweep`); the HTTP API's 422 says the same problems
(orchestrator/http/target_checks.py), and so does the Python client over Ray (`Client.submit_many` / `submit_run`:
`check_submission_targets`), which entered such a job, to fail on its trainer once placed. `aspen run` also
checks its `device` against this machine's GPUs and its `stages` / `stage_split` against the base's decoder layers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.jobs_file import SpecError, read_spec_text, yaml_lines

if TYPE_CHECKING:
    from actors.spec.job_spec import JobSpec
    from actors.spec.job_submission import JobSubmission
    from actors.spec.run_spec import RunSpec
    from actors.spec.sweep_spec import SweepSpec


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


CUDA_ONLY = {"kernels": ("liger", "runs Liger's Triton kernels on a CUDA GPU", "auto or none"),
             "compile": ("graphs", "captures each step as a CUDA graph", "none or default")}


def check_device(spec: RunSpec, file: str | Path, *, in_process: bool) -> None:
    """A `SpecError` naming the file's line and field where `device` asks for a CUDA GPU that the run, on this machine
    (in-process, or on the private Ray `aspen run` starts where RAY_ADDRESS is unset), cannot have, or where a setting
    only a GPU runs (kernels: liger, compile: graphs) meets a machine without one: its trainer would wait for a GPU for
    ever ("starting its process") or die as it started. On a cluster of RAY_ADDRESS another node may have the GPU:
    not checked then."""
    wants = [field for field, (value, _, _) in CUDA_ONLY.items() if getattr(spec, field) == value]
    if not (spec.device.startswith("cuda") or wants) or (not in_process and os.environ.get("RAY_ADDRESS")):
        return
    from actors.service.scheduler.cuda_devices import cuda_device_count

    count = cuda_device_count()
    index = int(spec.device.partition(":")[2] or 0) if in_process else 0   # on Ray the cluster picks the GPU
    have = "no CUDA GPU" if count == 0 else f"{count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
    if spec.device.startswith("cuda") and index >= count:
        field, problem = "device", (f"device: {spec.device}, but this machine has {have} (a CPU-only torch, no GPU "
                                    "or no driver; CUDA_VISIBLE_DEVICES narrows them); set device: auto (a GPU where "
                                    "there is one, else the CPU) or cpu, or run on a cluster with GPUs (RAY_ADDRESS)")
    elif wants and count == 0:
        field = wants[0]
        value, what, instead = CUDA_ONLY[field]
        problem = (f"{field}: {value} {what}, and this machine has {have}; set {field}: {instead}, or run on a "
                   "cluster with GPUs (RAY_ADDRESS)")
    else:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    raise SpecError(f"{_where(file, lines, (field,))}: {problem}\n(nothing was started: fix {field}, then run again)")


def decoder_layer_count(base_model: str) -> int | None:
    """The decoder layers of a base here: a folder's (its config.json's num_hidden_layers, or its text model's), or a
    GGUF file's, an alias's included (its header's block count, which transformers' converter makes num_hidden_layers);
    None where neither says (left to the trainer)."""
    import json

    from actors.storage.gguf_header import read_header
    from actors.storage.sources import resolve_source

    try:
        source = resolve_source(base_model)
        if source.gguf_file:
            return read_header(Path(source.path) / source.gguf_file).block_count
        config = json.loads((Path(source.path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        if isinstance(part, dict) and isinstance(part.get("num_hidden_layers"), int):
            return part["num_hidden_layers"]
    return None


def check_stage_split(spec: RunSpec, file: str | Path) -> None:
    """A `SpecError` at the file's line of `stages` / `stage_split` where the base's decoder cannot be cut so: more
    stages than its layers, or a split whose counts do not sum to them. Its trainer refused it once started (through
    Ray: 'no trainer could start', a remote traceback, exit 1)."""
    if spec.stages < 2:
        return
    layers = decoder_layer_count(spec.base_model)
    if layers is None:
        return
    if isinstance(spec.stage_split, list) and sum(spec.stage_split) != layers:
        field, problem = "stage_split", (f"stage_split {spec.stage_split} holds {sum(spec.stage_split)} decoder layers "
                                         f"and base {spec.base_model} has {layers}: give counts that sum to {layers}, "
                                         "or stage_split: even or measured")
    elif spec.stages > layers:
        field, problem = "stages", (f"stages: {spec.stages} for base {spec.base_model}'s decoder of {layers} layers: "
                                    f"a stage holds at least one layer; set stages to {layers} or fewer")
    else:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    raise SpecError(f"{_where(file, lines, (field,))}: {problem}\n(nothing was started: fix {field}, then run again)")


@dataclass(frozen=True)
class TargetProblem:
    """A `lora.target_modules` entry the base cannot take: where the file (or request) has it, its job, and why."""

    loc: tuple            # ('jobs', 0, 'lora', 'target_modules', 1); a sweep's ('job', ...) or ('space', ...)
    job: str
    target: str
    message: str          # the base's layer names, the nearest first

    @property
    def field(self) -> str:
        """The field its message names: lora.target_modules (a job's), job.lora.target_modules (a sweep's job's),
        space.lora.target_modules.choice.1 (a sweep's option)."""
        parts = self.loc[2:] if self.loc[0] == "jobs" else self.loc
        return ".".join(str(part) for part in (parts[:-1] if isinstance(parts[-1], int) else parts))


def jobs_target_problems(base_model: str, jobs: list[JobSpec]) -> list[TargetProblem]:
    """Each job's `lora.target_modules` entry that matches no linear layer of `base_model` (or names one its model
    type leaves alone), located as a jobs file's (`jobs.<index>.lora.target_modules.<position>`). A base whose layers
    cannot be read here is left to its trainer (orchestrator/target_layers.py)."""
    named = [(("jobs", index, "lora", "target_modules"), job.name, job.lora.target_modules)
             for index, job in enumerate(jobs)]
    return _problems(base_model, named)


def sweep_target_problems(spec: SweepSpec) -> list[TargetProblem]:
    """The same for a sweep: its job's `lora.target_modules` and each list its space gives that field."""
    named = [(("job", "lora", "target_modules"), spec.job.name, spec.job.lora.target_modules)]
    dimension = spec.parsed_space().get("lora.target_modules")
    if dimension is not None and dimension.kind == "choice":
        named += [(("space", "lora.target_modules", "choice", option), spec.job.name, value)
                  for option, value in enumerate(dimension.values)]
    return _problems(spec.base_model, named)


def _problems(base_model: str, named: list[tuple[tuple, str, list[str] | str]]) -> list[TargetProblem]:
    """Each list's names the base cannot take; a name for every linear layer (`all-linear`) is refused only where
    no job trains on the base at all (a GGUF architecture aspen cannot train: `base_refusal`), at its field."""
    from orchestrator.target_layers import base_refusal, target_problems

    targets = [target for _, _, values in named if isinstance(values, list) for target in values]
    found = (target_problems(base_model, targets) if targets else None) or {}
    refused = base_refusal(base_model) if any(not isinstance(values, list) for _, _, values in named) else None
    problems = []
    for where, job, values in named:
        if not isinstance(values, list):
            problems += [TargetProblem(where, job, values, refused)] if refused is not None else []
            continue
        problems += [TargetProblem((*where, position), job, target, str(found[target]).removeprefix(
            "lora.target_modules: ")) for position, target in enumerate(values) if found.get(target)]
    return problems


def check_target_modules(spec: RunSpec, file: str | Path, *, verb: str = "run") -> None:
    """A `SpecError` naming, for each job's `lora.target_modules` entry that matches no linear layer of the base (or
    names one its model type leaves alone), the file's line, the job, the name and the base's layer names (the
    nearest one first). A base whose config cannot be read or built is left to its trainer, which says why.
    `verb`: what the user does again once fixed (run, submit)."""
    problems = jobs_target_problems(spec.base_model, spec.jobs)
    if not problems:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    said = [f"{_where(file, lines, problem.loc)}: job '{problem.job}' (jobs[{problem.loc[1]}]), field "
            f"lora.target_modules: {problem.message}" for problem in problems]
    done = "submitted" if verb == "submit" else "started"
    raise SpecError("\n".join(said) + f"\n(nothing was {done}: fix the names for base {spec.base_model}, then "
                    f"{verb} again)")


def check_sweep_target_modules(spec: SweepSpec, file: str | Path) -> None:
    """The same for a sweep file (`aspen sweep`): its job's names, and each list its space gives them."""
    problems = sweep_target_problems(spec)
    if not problems:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    said = [f"{_where(file, lines, problem.loc)}: field {problem.field}: {problem.message}" for problem in problems]
    raise SpecError("\n".join(said) + f"\n(nothing was started: fix the names for base {spec.base_model}, then "
                    "run the sweep again)")


def check_submission_targets(submissions: list[JobSubmission]) -> None:
    """A `SpecError` naming, for each submission's `lora.target_modules` entry its base cannot take, the job (its
    place among the submissions), the field and entry, the name, the nearest one and the base's layer names; nothing
    is submitted. What `Client.submit_many` / `submit_run` check before they ask the service (as the HTTP API does)."""
    said = []
    bases = dict.fromkeys(submission.base_model for submission in submissions)
    for base in bases:
        places = [index for index, submission in enumerate(submissions) if submission.base_model == base]
        for problem in jobs_target_problems(base, [submissions[index].job for index in places]):
            said.append(f"job '{problem.job}' ({places[problem.loc[1]] + 1} of {len(submissions)}), field "
                        f"{'.'.join(map(str, problem.loc[2:]))} (base {base}): {problem.message}")
    if said:
        raise SpecError("nothing was submitted:\n" + "\n".join(said) + f"\n(fix the names for base "
                        f"{', '.join(bases)}, then submit again)")
