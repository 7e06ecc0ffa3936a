"""Jobs that start from another job's adapter (`init_adapter: job:<name>`, actors/spec/job_chains.py) in the
service: a submission's names become the job ids it enters them under; a queued job that waits on another is kept
out of the policy's snapshot until that job has ended, then starts from its adapter folder, which replaces the
reference in its submission (what `aspen status`, the console and a resumed job see from then on). Where the other
job ended without an adapter (failed, cancelled) or is gone, the waiting job fails, saying which and what to do."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.service.table.job_table import JobRecord, JobTable
from actors.spec.job_chains import chain_problem
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission
from actors.spec.saved_adapter import JOB_PREFIX, JobAdapter
from actors.storage.storage_uri import as_location

ENDED_WITH_AN_ADAPTER = ("completed", "stopped_early")


Lookup = Callable[[str, JobSubmission], "tuple[str, JobSpec] | None"]
"""An entered job by id or name, as `submission`'s submitter may start from it: (its id, its spec), or None."""


def chained(submissions: list[JobSubmission], ids: list[str], lookup: Lookup | None = None
            ) -> tuple[list[JobSubmission], list[str | None]]:
    """The submissions with each `job:<name>` made `job:<that job's id>`: a job of the same batch, else (`lookup`) a
    job entered before (one `aspen run` carries over from its last run, or any the submitter names by id or name);
    and per submission why its chain cannot be (None: it can, or it has none)."""
    by_name = {submission.job.name: submission.job for submission in submissions}
    id_of = {submission.job.name: job_id for submission, job_id in zip(submissions, ids, strict=True)}
    out: list[JobSubmission] = []
    problems: list[str | None] = []
    for submission in submissions:
        source = submission.job.init_adapter
        if not isinstance(source, JobAdapter):
            out.append(submission)
            problems.append(None)
            continue
        known, job_id = by_name, id_of.get(source.job)
        if job_id is None and lookup is not None and (found := lookup(source.job, submission)) is not None:
            job_id, spec = found
            known = {**by_name, source.job: spec.model_copy(update={"name": source.job})}
        problem = chain_problem(submission.job, known)
        problems.append(problem)
        if problem is not None or job_id is None:
            out.append(submission)
            continue
        job = submission.job.model_copy(update={"init_adapter": JobAdapter(JOB_PREFIX + job_id)})
        out.append(submission.model_copy(update={"job": job}))
    return out, problems


@dataclass(frozen=True)
class Settled:
    """A queued job's standing on the job it starts from: `submission` where it may start (its init_adapter now
    that job's folder), else `waiting` (why it waits) or `failed` (why it never can)."""

    submission: JobSubmission | None = None
    waiting: str | None = None
    failed: str | None = None


def settle(table: JobTable, record: JobRecord, submission: JobSubmission) -> Settled:
    """Where `record` (queued) waits on another job's adapter: whether it may start now, and from which folder."""
    source = submission.job.init_adapter
    if not isinstance(source, JobAdapter):
        return Settled(submission=submission)
    try:
        before = table.get(source.job)
    except KeyError:
        return Settled(failed=f"it starts from the adapter of job {source.job}, which is no longer in the job table; "
                              "give init_adapter the folder of an adapter and submit it again")
    if before.state in ENDED_WITH_AN_ADAPTER and before.adapter_dir:
        settled = _from_folder(submission, before)
        table.set_submission(record.id, settled)
        return Settled(submission=settled)
    if before.state in ENDED_WITH_AN_ADAPTER or before.state in ("failed", "cancelled"):
        what = "without an adapter" if before.state in ENDED_WITH_AN_ADAPTER else before.state
        return Settled(failed=f"it starts from the adapter of job {before.id}, which ended {what} ({before.reason}); "
                              f"resume that job (`aspen resume {before.id}`), then this one")
    return Settled(waiting=f"waits for job {before.id} ({before.state}) to end: it starts from that job's adapter")


def _from_folder(submission: JobSubmission, source: JobRecord) -> JobSubmission:
    """`submission` starting from the folder of the adapter `source` ended with."""
    job = submission.job.model_copy(update={"init_adapter": as_location(source.adapter_dir)})
    return submission.model_copy(update={"job": job})


def entered_as(table: JobTable, stored: JobSubmission, submission: JobSubmission) -> bool:
    """Whether `stored` (a job's submission in the table) is `submission` as it was entered: the same, or with its
    `job:<id>` replaced by that job's folder once that job ended (`settle`): a request repeated after a lost answer
    finds its job even after the job it waited on has ended."""
    if stored == submission:
        return True
    source = submission.job.init_adapter
    if not isinstance(source, JobAdapter) or isinstance(stored.job.init_adapter, JobAdapter):
        return False
    try:
        before = table.get(source.job)
    except KeyError:
        return False
    return bool(before.adapter_dir) and _from_folder(submission, before) == stored
