"""A submission's (a sweep's) `lora.target_modules` checked against its base's linear layers before its jobs are
entered (its sweep started), as `aspen run` checks a jobs file's (orchestrator/base_check.py): a name the base has no
linear layer of is refused 422 naming the job, the field (`jobs.0.lora.target_modules.1`, its YAML line where the
body was YAML), the name, the nearest one and the base's layer names, rather than the job failing on its trainer once
it was queued and placed. Reading a base's layers may take seconds (its model built on `meta` in a process of its
own: orchestrator/target_layers.py, which keeps them per base): called off the event loop. A base this machine does
not have is left to its trainer. Ray-free; imports no torch."""

from __future__ import annotations

from typing import Any

from actors.spec.job_submission import JobSubmission
from actors.spec.sweep_spec import SweepSpec
from orchestrator.base_check import TargetProblem, jobs_target_problems, sweep_target_problems
from orchestrator.http.request_bodies import refusal
from orchestrator.jobs_file import yaml_lines


def check_targets(submissions: list[JobSubmission], *, single_job: bool, text: str | None = None) -> None:
    """`Refused` (422) naming each job's `lora.target_modules` entry its base cannot take; `single_job`: the body
    was one job's fields (located at `lora.target_modules.<i>`, not `jobs.<index>.`); `text`: a jobs file's YAML."""
    index_of = {submission.job.name: index for index, submission in enumerate(submissions)}
    problems: list[dict[str, Any]] = []
    bases = dict.fromkeys(submission.base_model for submission in submissions)
    for base in bases:
        jobs = [submission.job for submission in submissions if submission.base_model == base]
        for problem in jobs_target_problems(base, jobs):   # located by the job's place among its base's
            index = index_of[problem.job]
            loc = list(problem.loc[2:]) if single_job else ["jobs", index, *problem.loc[2:]]
            problems.append(_entry(problem, loc, base))
    if not problems:
        return
    lines = yaml_lines(text) if text and not single_job else {}
    _add_lines(problems, lines)
    names = [submission.job.name for submission in submissions]
    raise refusal(problems, single_job, names, then=f"(fix the names for base {', '.join(bases)}, then submit again)")


def check_sweep_targets(spec: SweepSpec, text: str | None = None) -> None:
    """`Refused` (422) naming the sweep's `job.lora.target_modules` entries (and the space's
    `space.lora.target_modules.choice.<option>` ones) its base cannot take."""
    problems = [_entry(problem, list(problem.loc), spec.base_model) for problem in sweep_target_problems(spec)]
    if not problems:
        return
    _add_lines(problems, yaml_lines(text) if text else {})
    raise refusal(problems, True, [spec.job.name],
                  then=f"(nothing was started: fix the names for base {spec.base_model}, then send the sweep again)")


def _entry(problem: TargetProblem, loc: list[Any], base: str) -> dict[str, Any]:
    return {"loc": loc, "field": ".".join(map(str, loc)), "type": "target_module", "job": problem.job,
            "target": problem.target, "base_model": base, "msg": problem.message}


def _add_lines(problems: list[dict[str, Any]], lines: dict[tuple, int]) -> None:
    for problem in problems:
        line = lines.get(tuple(problem["loc"]))
        if line is not None:
            problem["line"] = line
