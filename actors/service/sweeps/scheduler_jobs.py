"""The scheduler's own calls as a sweep's `SweepJobs` (actors/service/sweeps/sweep_driver.py): the sweeps the
service runs submit, follow and cancel their trials through the scheduler's core and job table directly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.service.scheduler.scheduler_core import QuotaExceeded, SchedulerCore
from actors.service.sweeps.sweep_driver import TrialWaits
from actors.service.table.job_table import JobRecord, JobTable
from actors.spec.job_spec import JobSpec
from actors.spec.job_submission import JobSubmission


class SchedulerJobs:
    def __init__(self, core: SchedulerCore, table: JobTable, cancel: Callable[[str, str], Any]):
        """`cancel`: the scheduler's own cancel (a running trial is stopped on its trainer)."""
        self.core, self.table, self._cancel = core, table, cancel

    def submit(self, job: JobSpec, *, job_id: str, base_model: str, seed: int, output_dir: str,
               user: str | None = None) -> str:
        """The trial's job entered under `job_id` (the sweep's choice: one entered under it before, the same
        submission, is answered with, not entered again); a refusal of its user's quota (for now: their queued jobs,
        their daily tokens) is a TrialWaits (the sweep submits it again later), any other refusal the scheduler's
        SubmissionError."""
        submission = JobSubmission(job=job, base_model=base_model, seed=seed, output_dir=output_dir, user=user)
        try:
            return self.core.submit_many([submission], job_ids=[job_id])[0].id
        except QuotaExceeded as error:
            raise TrialWaits(str(error), error.retry_after) from error

    def folder_problem(self, job: JobSpec, *, base_model: str, seed: int, output_dir: str,
                       user: str | None = None) -> str | None:
        submission = JobSubmission(job=job, base_model=base_model, seed=seed, output_dir=output_dir, user=user)
        return self.core.submissions.folder_problem(submission)

    def check_quota(self, job: JobSpec, *, base_model: str, seed: int, output_dir: str,
                    user: str | None = None) -> None:
        submission = JobSubmission(job=job, base_model=base_model, seed=seed, output_dir=output_dir, user=user)
        """The scheduler's QuotaExceeded (the HTTP API's 429) where `user`'s quotas would refuse this job now."""
        self.core.submissions.check_quota([submission], f"nothing was started: the sweep's first trial '{job.name}' is "
                                                       "over its user's quota: ")

    def status(self, job_id: str) -> JobRecord:
        return self.table.get(job_id)

    def losses(self, job_id: str) -> list[dict[str, Any]]:
        return self.table.progress.of_job(job_id)

    def cancel(self, job_id: str, reason: str) -> None:
        self._cancel(job_id, reason)

    def job_ids(self) -> set[str]:
        return {record.id for record in self.table.all()}

    def moved(self, job_id: str, old_dir: str, new_dir: str) -> bool:
        """An ended trial's job whose folder `old_dir` moves to `new_dir` (a replaced sweep's: replaced_sweeps.py):
        its record's output_dir (where `aspen export`, `aspen resume` find it) and its submission's follow. False
        where the job writes elsewhere (the folder is not its: left where it is); a job deleted since: True."""
        try:
            record = self.table.get(job_id)
        except KeyError:
            return True
        if Path(record.output_dir) != Path(old_dir):
            return Path(record.output_dir) == Path(new_dir)   # moved before (a replacement cut short)
        submission = self.table.submission(job_id)
        with self.table.transaction():
            self.table.update(job_id, output_dir=new_dir)
            if submission.output_dir is not None and Path(str(submission.output_dir)) == Path(old_dir):
                self.table.set_submission(job_id, submission.model_copy(update={"output_dir": Path(new_dir)}))
        return True
