"""What differs between two submissions of a job, as `aspen run` started again compares a jobs file's job with
the one an earlier run trained (orchestrator/run_plan.py), leaving out the fields that do not change what its
steps compute; and whether the difference is only a raised budget (`max_steps`, `epochs` or both), which a job
continues to from its checkpoint (`SchedulerCore.extend`), or a budget changed in a way it cannot continue to."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


BUDGET_FIELDS = ("max_steps", "epochs")


@dataclass(frozen=True)
class BudgetRaise:
    """A job's budget raised, everything else unchanged: its `max_steps`, its `epochs` or both (each either kept or
    raised), which it continues to from its checkpoint."""

    before: JobSpec
    after: JobSpec

    @property
    def raised(self) -> tuple[str, ...]:
        """The fields raised: "max_steps", "epochs" or both."""
        return tuple(name for name in BUDGET_FIELDS if getattr(self.before, name) != getattr(self.after, name))

    def describe(self, verb: str = "") -> str:
        """'max_steps 3 -> 4', 'epochs 1 -> 2' or both, joined by ', ' (`verb`, e.g. "raised", after each name)."""
        return ", ".join(f"{' '.join(filter(None, (name, verb)))} {getattr(self.before, name):g} -> "
                         f"{getattr(self.after, name):g}" for name in self.raised)

    def planned_total(self, total_steps: int | None) -> int | None:
        """The steps the raised job is reckoned to train to until its trainer plans them (its data read, its
        checkpoint's position known: `job_spec.continued_steps`), from `total_steps`, those its last start planned:
        a raised epochs adds that many epochs' worth of its steps (`total_steps` over its epochs), a raised max_steps
        is the new bound, the smaller where both bound it. None where its last start planned none."""
        if total_steps is None:
            return None
        before, after = self.before, self.after
        bounds = []
        if after.epochs is not None and epochs_bind(before, total_steps):
            per_epoch = total_steps / before.epochs if before.epochs else 0
            bounds.append(total_steps + math.ceil(per_epoch * (after.epochs - before.epochs)))
        if after.max_steps is not None:
            bounds.append(after.max_steps)
        return min(bounds) if bounds else total_steps

    def raised_to(self) -> str:
        """'max_steps raised to 10', 'epochs raised to 2' or both, joined by ' and '."""
        return " and ".join(f"{name} raised to {getattr(self.after, name):g}" for name in self.raised)


class BudgetRefused(ValueError):
    """A budget changed in a way a job cannot continue to from its checkpoint: why, and what to do instead;
    `field`: which ("max_steps" or "epochs")."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def budget_raise(old: JobSubmission, new: JobSubmission) -> BudgetRaise | None:
    """The raise where the only differences between two submissions of a job are a raised `max_steps`, a raised
    `epochs` or both (the other kept); None where anything else differs or nothing does. A budget changed
    otherwise (lowered, added, removed) raises `BudgetRefused`, saying why."""
    before, after = old.job, new.job
    kept = new.model_copy(update={"job": after.model_copy(update={name: getattr(before, name)
                                                                  for name in BUDGET_FIELDS})})
    if differences(old, kept) or all(getattr(before, name) == getattr(after, name) for name in BUDGET_FIELDS):
        return None
    for name in BUDGET_FIELDS:
        was, now = getattr(before, name), getattr(after, name)
        if was == now or (was is not None and now is not None and now > was):
            continue
        raise BudgetRefused(_refusal(name, was, now), name)
    return BudgetRaise(before, after)


def _refusal(name: str, was: float | None, now: float | None) -> str:
    if name == "epochs" and was is None:
        return (f"epochs added ({now:g}) to a job that had none: its data was repeated until its max_steps, each "
                "batch running on across the end of an epoch, and with epochs it would end with its data's last "
                "epoch, a different data order than it trained on; keep epochs out of it and raise max_steps to "
                "continue it, or start a new job (init_adapter: job:NAME continues from its adapter)")
    if now is None:
        return (f"{name} removed (it was {was:g}): a job continues only to a larger budget of the same kind; raise "
                f"its {name} instead, or start a new job (init_adapter: job:NAME continues from its adapter)")
    if was is None:   # max_steps added to a job its epochs alone bound
        return (f"bound by epochs, not max_steps: it has no max_steps to raise (with max_steps {now:g} its data would "
                "run on across its last epoch's end, a different data order); raise its epochs to continue it (aspen "
                "extend JOB --epochs N, or epochs in its jobs file), or start a new job (init_adapter: job:NAME "
                "continues from its adapter)")
    return (f"{name} lowered {was:g} -> {now:g}: a job continues from its checkpoint only to a larger budget; give "
            f"{name} above {was:g}, or start a new job to train it less")


def raise_trains_nothing(raised: BudgetRaise, total_steps: int | None) -> str | None:
    """Why continuing a job to `raised` would train nothing (what ended it is not raised: its epochs, or its
    max_steps), and what to do; None where it trains on. `total_steps`: the steps its last start planned."""
    before = raised.before
    if epochs_bind(before, total_steps) and "epochs" not in raised.raised:
        return epochs_bound_reason(before, total_steps)
    if not epochs_bind(before, total_steps) and "max_steps" not in raised.raised:
        return (f"bound by max_steps: its max_steps {before.max_steps} ended it before its {before.epochs:g} "
                f"epoch(s) of data did, so a larger epochs alone would train nothing more; raise max_steps too "
                "(aspen extend JOB --max-steps N --epochs N, or both in its jobs file)")
    return None


def raise_ends_at_once(raised: BudgetRaise, step: int, cursor: dict[str, Any]) -> str | None:
    """Why continuing a job to `raised` from its checkpoint at `step`, its data cursor's state there `cursor`, would
    train nothing: its data already ran to its end through as many epochs as the raised budget gives (a fractional
    epochs's last epoch read whole, say 1.5 raised to 2), so the total it continues to is the step it is at; and what
    to do. None where it trains on, or where the cursor does not say how many examples its data has (a streamed job's
    counts rows, where they were counted; one checkpointed by an older aspen does not say: `earlier_outputs.
    raise_trains_nothing_from` counts them again from its data first)."""
    from actors.spec.job_spec import continued_steps  # this module is kept light (see above)

    streamed = "num_examples" not in cursor
    examples = cursor.get("num_rows" if streamed else "num_examples")
    if not isinstance(examples, int) or examples < 1:
        return None
    total = continued_steps(raised.after, examples, step, cursor)
    if total is None or total > step:
        return None
    epochs = int(cursor.get("epoch", 0)) + 1
    return (f"at its data's end: its checkpoint at step {step} has read each of its {examples} training "
            f"{'rows' if streamed else 'examples'} "
            f"{epochs} time(s), all that epochs {raised.after.epochs:g} gives, so the new total is step {step}, the "
            f"step it is at, and it would train nothing more; give epochs above {epochs} to continue it into more of "
            "its data (aspen extend JOB --epochs N, or epochs in its jobs file)")


def epochs_bind(job: JobSpec, total_steps: int | None) -> bool:
    """Whether a job's `epochs`, not its `max_steps`, ended its training: it has no max_steps, or its data's epochs
    gave fewer steps (`total_steps`, what its last start planned) than its max_steps. Such a job has no budget a
    raised max_steps alone would add to: it would end again at once (a raised epochs continues it)."""
    if job.max_steps is None:
        return True
    return job.epochs is not None and total_steps is not None and total_steps < job.max_steps


def epochs_bound_reason(job: JobSpec, total_steps: int | None) -> str:
    """Why a raised max_steps alone does not continue a job `epochs_bind` holds, and what to do instead."""
    if job.max_steps is None:
        why = "bound by epochs, not max_steps: it has no max_steps to raise"
    else:
        why = (f"bound by epochs: its {job.epochs:g} epoch(s) of data ended it at step {total_steps}, before its "
               f"max_steps {job.max_steps}, so a larger max_steps alone would train nothing more")
    return why + ("; raise its epochs to continue it into more of its data (aspen extend JOB --epochs N, or epochs "
                  "in its jobs file), or start a new job (init_adapter: job:NAME continues from its adapter)")
