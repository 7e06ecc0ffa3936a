"""Jobs that start from another job's adapter (`init_adapter: job:<name>`): what makes such a chain impossible, told
before anything is entered (torch-free). The other job must be one of the same submission, not the job itself, not
waiting on it in turn (a cycle), and must save an adapter of this job's shape: its kind, rank, alpha, rsLoRA, DoRA
(as it saves them: a PiSSA / OLoRA adapter as PEFT's plain conversion of twice the rank) and the same modules."""

from __future__ import annotations

from collections.abc import Mapping

from actors.spec.job_spec import JobSpec
from actors.spec.saved_adapter import JobAdapter, config_problems, saved_form


def chain_problem(job: JobSpec, jobs: Mapping[str, JobSpec]) -> str | None:
    """Why `job`'s `init_adapter: job:<name>` cannot be (None: it can), among `jobs` (by name: the submission's)."""
    source = job.init_adapter
    if not isinstance(source, JobAdapter):
        return None
    if source.job == job.name:
        return f"init_adapter: {source} is this job itself; name another job of the same submission"
    if source.job not in jobs:
        names = ", ".join(sorted(name for name in jobs if name != job.name)) or "none"
        return (f"init_adapter: {source} names no job of the same submission (the others: {names}); name one of "
                "them, or give the folder of a finished job's adapter")
    path, current = [job.name], jobs[source.job]
    while True:
        path.append(current.name)
        if current.name == job.name:
            return (f"init_adapter: {source} makes a cycle ({' -> '.join(path)}): each job would wait for the "
                    "other's adapter; start one of them from a folder or from its own initialisation")
        following = current.init_adapter
        if not isinstance(following, JobAdapter) or following.job not in jobs or len(path) > len(jobs):
            break
        current = jobs[following.job]
    before = jobs[source.job]
    problems = config_problems(saved_form(before.lora), job.lora)
    ours, theirs = job.lora.target_modules, before.lora.target_modules
    if isinstance(ours, list) and isinstance(theirs, list) and set(ours) != set(theirs):
        problems.append(f"lora.target_modules is {ours}, job '{before.name}' adapts {theirs}: set "
                        f"lora.target_modules: {theirs}")
    elif (ours == "all-linear") != (theirs == "all-linear"):
        problems.append(f"lora.target_modules is {ours!r}, job '{before.name}' adapts {theirs!r}: give both the same "
                        "target_modules")
    if problems:
        return f"init_adapter: job '{before.name}' saves an adapter that does not fit this job's lora: " + \
            "; ".join(problems)
    return None
