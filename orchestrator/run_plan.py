"""`aspen run` started again on the same output folder: what to do with each job of the jobs file, given the
jobs its service's table already holds from earlier runs. A job trained to its end is left alone; an
unfinished one (interrupted, failed, cancelled, or held since the last run stopped) resumes from its
checkpoint; a new one is submitted. A job whose spec changed in a way that makes its checkpoint wrong for
it (data, model, adapter, optimisation, budget), or whose data changed since its checkpoint (the digest
the checkpoint records, actors/data/digest.py, against the data's now: a file rewritten in place), is
not resumed: the run stops and says which job, what changed, and that `--overwrite` starts that job over.
`--overwrite` starts over only those jobs: a job whose spec and data are unchanged is never deleted by it.
An unfinished job that left no checkpoint (a job that failed at its start, say on a reward that raised) has
nothing to mix with: with its spec changed it starts again on the new spec, without `--overwrite`. A job whose
only change is a raised `max_steps`, `epochs` or both (its data unchanged) continues from its checkpoint to the new
budget, finished or not, as transformers' `resume_from_checkpoint` with a larger `max_steps` or `num_train_epochs`
does: its learning-rate schedule is the new budget's from the step it continues at (with `lr_schedule: constant`,
exactly the longer run where its rows are a multiple of batch_size; a raised epochs trains on into its next epoch from
its first row: `job_spec.continued_steps`). A raise that would train nothing (what ended the job is not raised) leaves
it alone, saying so; a lowered epochs, or epochs added to a job that had none, is a changed spec saying why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from actors.spec.submission_changes import (
    BudgetRaise,
    BudgetRefused,
    budget_raise,
    differences,
    raise_trains_nothing,
)
from actors.storage.storage_uri import resolve_location

if TYPE_CHECKING:   # the CLI imports this module for its --overwrite text: kept light
    from actors.service.outputs.earlier_outputs import EarlierOutputs
    from actors.service.table.job_table import JobRecord
    from actors.spec.job_submission import JobSubmission

FINISHED = ("completed", "stopped_early")


@dataclass
class RunPlan:
    submit: list[JobSubmission] = field(default_factory=list)    # new jobs
    resume: list[JobRecord] = field(default_factory=list)        # unfinished, same spec
    done: list[JobRecord] = field(default_factory=list)          # finished, same spec: left alone
    changed: list[tuple[str, list[str]]] = field(default_factory=list)   # job name, its differences
    changed_records: list[JobRecord] = field(default_factory=list)        # the earlier jobs of `changed`
    retry: list[tuple[JobRecord, list[str]]] = field(default_factory=list)   # unfinished, no checkpoint, changed
    extend: list[tuple[JobRecord, JobSubmission]] = field(default_factory=list)   # checkpointed, budget raised
    raises: dict[str, BudgetRaise] = field(default_factory=dict)   # the raise of each of `extend`, by its record's id
    notes: list[str] = field(default_factory=list)   # why a job is left alone where the file may suggest otherwise
    # new jobs whose folders hold outputs no job of the table wrote there: (job name, what was found)
    foreign: list[tuple[str, EarlierOutputs]] = field(default_factory=list)
    # jobs whose checkpoint the table records is gone from their folder, so they cannot continue: (record, why)
    lost: list[tuple[JobRecord, str]] = field(default_factory=list)

    @property
    def started_over(self) -> list[JobRecord]:
        """The earlier jobs `--overwrite` starts over: those whose spec or data changed, and those whose checkpoint
        is gone."""
        return [*self.changed_records, *(record for record, _ in self.lost)]

    def started_over_lines(self, deleted: str) -> list[str]:
        """One line per earlier job --overwrite starts over, with why (`deleted`: "were" or "are")."""
        out = [f"{record.name}: started over (--overwrite: its spec or data changed); its earlier results {deleted} "
               "deleted" for record in self.changed_records]
        return out + [f"{record.name}: started over from step 0 (--overwrite: its checkpoint at step "
                      f"{record.checkpoint_step} is gone); its earlier results {deleted} deleted"
                      for record, _ in self.lost]

    def lines(self, saved_step: Callable[[str], int | None] | None = None) -> list[str]:
        """One line per job that was there before. `saved_step(output_dir)`: the step of the checkpoint on
        disk, which a run killed at once may not have reported to its table."""
        out = [f"{r.name}: already {r.state} at step {r.step}; left alone" for r in self.done] + self.notes
        out += [f"{r.name}: {r.state} in the last run with no checkpoint; starts again with the changed spec "
                f"({'; '.join(items)})" for r, items in self.retry]
        for record in self.resume:
            step = saved_step(record.output_dir) if saved_step is not None else None
            step = step if step is not None else record.checkpoint_step
            where = f"its checkpoint at step {step}" if step else "the start"
            out.append(f"{record.name}: unfinished in the last run ({record.reason}); resumes from {where}")
        for record, submission in self.extend:
            step = saved_step(record.output_dir) if saved_step is not None else None
            step = step if step is not None else record.checkpoint_step
            raised = self.raises.get(record.id)
            what = raised.raised_to() if raised is not None else f"max_steps raised to {submission.job.max_steps}"
            out.append(f"{record.name}: {record.state} at step {record.step}; {what}: it continues from its "
                       f"checkpoint at step {step}")
        return out


def data_changes(submission: JobSubmission, saved: tuple[int, str | None] | None) -> list[str]:
    """The job's data now against `saved`, the (step, data digest) of its checkpoint: one line where they
    differ; none without a checkpoint, with one that records no digest (an older aspen's), or where the data
    cannot be read now (the job's start then says why)."""
    if saved is None or saved[1] is None:
        return []
    from actors.data.digest import describe_change, job_data_digest
    from actors.data.rows import DataError

    step, digest = saved
    job = submission.job
    try:
        current = job_data_digest(job.data, job.split, streaming=job.streaming)
    except (DataError, OSError):
        return []
    if current == digest:
        return []
    return [f"data: {job.data} changed since its checkpoint at step {step} ({describe_change(digest, current)})"]


def plan_run(submissions: list[JobSubmission], records: list[JobRecord],
             stored: Callable[[str], JobSubmission],
             saved_data: Callable[[str], tuple[int, str | None] | None] | None = None,
             saved_step: Callable[[str], int | None] | None = None,
             found_outputs: Callable[[str], EarlierOutputs | None] | None = None) -> RunPlan:
    """Match each submission with the newest earlier job of the same name writing to the same folder.
    `saved_data(output_dir)`: the (step, data digest) of the job's checkpoint there, to compare its data with;
    `saved_step(output_dir)`: the step of a checkpoint on disk (a run killed at once may not have told its
    table), which, with the table's, tells whether an unfinished job left one; `found_outputs(output_dir)`: the
    outputs a job left in a folder (actors/service/outputs/earlier_outputs.py), asked of each new job's folder: one
    that holds some (the folder copied or moved, its table deleted) is in `foreign`, which the run refuses."""
    latest: dict[tuple[str, str], JobRecord] = {}
    for record in sorted(records, key=lambda r: r.submitted_at):
        latest[(record.name, str(resolve_location(record.output_dir)))] = record
    plan = RunPlan()
    for submission in submissions:
        assert submission.output_dir is not None, "a run's jobs always name their folder"
        record = latest.get((submission.job.name, str(resolve_location(submission.output_dir))))
        if record is None:
            plan.submit.append(submission)
            found = found_outputs(str(submission.output_dir)) if found_outputs is not None else None
            if found is not None:
                plan.foreign.append((submission.job.name, found))
            continue
        earlier = stored(record.id)
        changes = differences(earlier, submission)
        try:
            raised = budget_raise(earlier, submission) if _checkpointed(record, saved_step) else None
        except BudgetRefused as refused:   # a changed spec (an epochs one saying why it cannot continue)
            raised = None
            if refused.field == "epochs":
                changes = [*(c for c in changes if not c.startswith("epochs:")), str(refused)]
        if raised is not None and saved_step is not None and saved_step(record.output_dir) is None:
            plan.lost.append((record, f"{raised.describe('raised')}, but its checkpoint at "
                                      f"step {record.checkpoint_step} is no longer in its folder {record.output_dir} "
                                      "(deleted, moved or damaged), so it cannot continue from it"))
            continue   # --overwrite starts it over
        data = []
        if (not changes or raised is not None) and saved_data is not None:
            data = data_changes(submission, saved_data(record.output_dir))
        if raised is not None and not data and record.state == "stopped_early" and submission.job.early_stop:
            plan.done.append(record)   # its stop rule would end it again at once
            plan.notes.append(f"{record.name}: its stop rule ended it at step {record.step}, and would again at once: "
                              f"a raised {' and '.join(raised.raised)} continues it without early_stop (remove it "
                              "from the job)")
            continue
        nothing = _trains_nothing(raised, record) if raised is not None and not data else None
        if nothing is not None:
            plan.done.append(record)   # what ended it is not raised: it would end again at once
            plan.notes.append(f"{record.name}: {raised.raised_to()}, but it is {nothing}")
            continue
        if raised is not None and not data:   # only its budget raised: it continues from its checkpoint
            plan.extend.append((record, submission))
            plan.raises[record.id] = raised
            continue
        changes += data
        if changes and record.state not in FINISHED and not _checkpointed(record, saved_step):
            plan.retry.append((record, changes))
            plan.submit.append(submission)
        elif changes:
            plan.changed.append((submission.job.name, changes))
            plan.changed_records.append(record)
        elif record.state in FINISHED:
            plan.done.append(record)
        elif record.checkpoint_step and saved_step is not None and saved_step(record.output_dir) is None:
            plan.lost.append((record, f"{record.state} at step {record.step}, but its checkpoint at step "
                                      f"{record.checkpoint_step} is no longer in its folder {record.output_dir} "
                                      "(deleted, moved or damaged), so it cannot resume from it"))
        else:
            plan.resume.append(record)
    carried = {record.name: record.id for record in (*plan.done, *plan.resume, *(r for r, _ in plan.extend))}
    plan.submit = [_from_carried(submission, carried) for submission in plan.submit]
    return plan


def _trains_nothing(raised: BudgetRaise, record: JobRecord) -> str | None:
    """Why continuing `record` to `raised` would train nothing: what ended it is not raised, or its data already ran to
    the end the raised budget gives (its checkpoint's data cursor); None where it trains on."""
    from actors.service.outputs.earlier_outputs import raise_trains_nothing_from  # kept light: see above

    return raise_trains_nothing(raised, record.total_steps) or raise_trains_nothing_from(raised, record.output_dir)


def _from_carried(submission: JobSubmission, carried: dict[str, str]) -> JobSubmission:
    """A new job whose `init_adapter: job:<name>` names a job this run carries over (done, or resumed) rather than
    submits: that job named by its id, which the service finds whatever other jobs share its name."""
    source = submission.job.init_adapter
    if not str(source or "").startswith("job:") or str(source)[4:] not in carried:
        return submission
    from actors.spec.saved_adapter import JobAdapter  # the CLI's --overwrite text imports this module: kept light

    job = submission.job.model_copy(update={"init_adapter": JobAdapter("job:" + carried[str(source)[4:]])})
    return submission.model_copy(update={"job": job})


def _checkpointed(record: JobRecord, saved_step: Callable[[str], int | None] | None) -> bool:
    if record.checkpoint_step:
        return True
    return bool(saved_step(record.output_dir)) if saved_step is not None else False


OVERWRITE_HELP = ("start over the jobs whose spec or data changed since their last run or whose checkpoint is gone "
                  "from their folder, and the new jobs whose folders hold outputs the job table has no record of (a "
                  "copied or moved folder): their checkpoints, adapters and metrics are deleted; the file's other jobs "
                  "resume or are left alone as without it")


def changed_message(output_dir: Path, changed: list[tuple[str, list[str]]]) -> str:
    jobs, names = _listed([(name, "; ".join(items)) for name, items in changed])
    return (f"{output_dir} holds jobs of an earlier run whose spec or data differ from this file's, so resuming "
            f"them would mix two configurations:\n{jobs}\nrestore those fields or that data, or run with --overwrite "
            f"to start {names} over (their checkpoints, adapters and metrics are deleted; {OTHERS}), or give the run "
            "another output_dir")


def lost_message(output_dir: Path | str, lost: list[tuple[JobRecord, str]]) -> str:
    """Why the run does not start: jobs it would continue from their checkpoints no longer have them (each job with
    why), and the two ways on."""
    jobs, names = _listed([(record.name, why) for record, why in lost])
    return (f"{output_dir} holds jobs of an earlier run that this file continues, but the checkpoints they would "
            f"continue from are gone:\n{jobs}\nput each checkpoint back in its job's folder (checkpoint/) and run "
            f"again to continue from it, or run with --overwrite to start {names} over from step 0 (their adapters "
            f"and metrics are deleted; {OTHERS})")


OTHERS = "the file's other jobs resume or are left alone as without it"


def _listed(jobs: list[tuple[str, str]]) -> tuple[str, str]:
    """(one '  job 'NAME': WHY' line each, the names quoted and joined) for a refusal's message."""
    return "\n".join(f"  job '{name}': {why}" for name, why in jobs), ", ".join(f"'{name}'" for name, _ in jobs)


def foreign_message(output_dir: Path | str, foreign: list[tuple[str, EarlierOutputs]],
                    records: list[JobRecord]) -> str:
    """Why the run does not start: new jobs' folders hold outputs of a run its table has no record of there (each
    with what was found), what the table has of jobs of those names elsewhere, and what to do."""
    lines = []
    for name, found in foreign:
        lines.append(f"  job '{name}': {found.folder} holds {found.describe()}")
        elsewhere = sorted({r.output_dir for r in records if r.name == name and r.output_dir != str(found.folder)})
        for folder in elsewhere:   # the folder this table's job wrote to: the run whose output_dir holds it knows it
            lines.append(f"    its table records job '{name}' in {folder}: a run with output_dir {Path(folder).parent} "
                         "resumes it or leaves it alone there (move this folder back if it was moved from there)")
    names = ", ".join(f"'{name}'" for name, _ in foreign)
    return (f"the job folders of {output_dir} hold the outputs of a run whose jobs its job table "
            f"({Path(str(output_dir)) / '.aspen' / 'jobs.sqlite'}) has no record of there (the folder was copied or "
            f"moved, or its table deleted), so this run would train over them:\n" + "\n".join(lines) + "\n"
            f"give this run another output_dir (--output-dir), or run with --overwrite to delete those outputs and "
            f"start {names} over there")
