"""What differs between two submissions of a job, as `aspen run` started again compares a jobs file's job with
the one an earlier run trained (orchestrator/run_plan.py), leaving out the fields that do not change what its
steps compute; and whether the difference is only a raised budget, which a job continues to from its checkpoint
(`SchedulerCore.extend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # the CLI's parser imports this module (through orchestrator/run_plan.py): kept light
    from actors.spec.job_spec import JobSpec
    from actors.spec.job_submission import JobSubmission

# Fields a resumed job may change without making its checkpoint wrong: they decide when it is evaluated,
# checkpointed, stopped early or scheduled, not what a step computes.
SAFE_TO_CHANGE = {"job.priority", "job.eval_every", "job.checkpoint_every", "job.checkpoint_every_s", "job.early_stop",
                  "job.tracking"}


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): data}


def differences(old: JobSubmission, new: JobSubmission) -> list[str]:
    """What differs between two submissions of a job, as 'field: old -> new', leaving out the fields that
    do not change what the job computes (SAFE_TO_CHANGE)."""
    before, after = flatten(old.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    found = []
    for key in sorted(set(before) | set(after)):
        if any(key == safe or key.startswith(safe + ".") for safe in SAFE_TO_CHANGE):
            continue
        if key == "job.init_adapter" and str(after.get(key) or "").startswith("job:"):
            continue   # `job:<name>` is entered as that job's id, then its folder: that job's own changes show
        if before.get(key) != after.get(key):
            found.append(f"{key.removeprefix('job.')}: {before.get(key)!r} -> {after.get(key)!r}")
    return found


def budget_raise(old: JobSubmission, new: JobSubmission) -> int | None:
    """The new `max_steps` where it is the only difference between two submissions of a job and raises a budget
    `max_steps` bound (one bound by epochs alone would change its data cursor's end); None otherwise."""
    before, after = old.job.max_steps, new.job.max_steps
    if before is None or after is None or after <= before:
        return None
    raised = new.model_copy(update={"job": new.job.model_copy(update={"max_steps": before})})
    return after if not differences(old, raised) else None


def epochs_bind(job: JobSpec, total_steps: int | None) -> bool:
    """Whether a job's `epochs`, not its `max_steps`, ended its training: it has no max_steps, or its data's epochs
    gave fewer steps (`total_steps`, what its last start planned) than its max_steps. Such a job has no budget a
    raised max_steps would add to: it would end again at once."""
    if job.max_steps is None:
        return True
    return job.epochs is not None and total_steps is not None and total_steps < job.max_steps


def epochs_bound_reason(job: JobSpec, total_steps: int | None) -> str:
    """Why a raised max_steps does not continue a job `epochs_bind` holds, and what to do instead."""
    if job.max_steps is None:
        why = "bound by epochs, not max_steps: a budget raised would move where its data ends"
    else:
        why = (f"bound by epochs: its {job.epochs:g} epoch(s) of data ended it at step {total_steps}, before its "
               f"max_steps {job.max_steps}, so a larger max_steps would train nothing more")
    return why + "; start a new job (init_adapter: job:NAME continues from its adapter)"
