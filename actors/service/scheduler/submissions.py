"""Entering jobs in the job table, all or none: a batch of submissions is checked whole (ids, output folders,
what no trainer could ever run) before anything is written, then entered in one transaction.

A request repeated under the same client-chosen ids returns the jobs it entered the first time."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from actors.service.accounts.users import User, UserBook, UserError
from actors.service.outputs.earlier_outputs import earlier_outputs
from actors.service.scheduler.chained_jobs import chained, entered_as
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.data_roots import Location, as_root, data_problem
from actors.service.scheduler.job_fit import job_adapter_bytes, never_fits, trainer_view
from actors.service.scheduler.quotas import quota_problems
from actors.service.table.job_table import ACTIVE_STATES, JOB_STATES, JobRecord, JobTable
from actors.service.trainer.trainer_reports import TrainerStatus
from actors.spec.job_spec import JobSpec, step_limit_problem
from actors.spec.job_submission import JobSubmission
from actors.spec.saved_adapter import AdapterFileError, JobAdapter, check_adapter_config
from actors.spec.trainer_settings import step_tokens_floor
from actors.spec.user_functions import allowed
from actors.storage.storage_errors import StorageError
from actors.storage.storage_uri import StorageURI, as_location, is_uri

log = logging.getLogger(__name__)
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,71}$")


class SubmissionError(ValueError):
    """A submission the service cannot take; nothing of its batch was entered. `folder`: the job's own output
    folder where the message names it (a batch whose jobs fail alike is then told once, the folder written
    `<...>/<job name>`)."""

    def __init__(self, message: str, *, folder: str | None = None):
        super().__init__(message)
        self.folder = folder


class QuotaExceeded(SubmissionError):
    """A submission (or a job queued again) its user's quota does not allow now, the spec itself fine: waiting
    frees it (their queued jobs starting or ending, their trained tokens ageing out of the last 24 hours;
    actors/service/scheduler/quotas.py). `retry_after`: seconds until it may pass where that can be computed (the
    daily tokens), else a hint; None where a quota of 0 refuses it, which no wait frees (an admin raises it). The HTTP
    API answers it 429, with Retry-After where there is a wait. Nothing of its batch was entered."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _longest(problems: list[tuple[str, float | None]]) -> float | None:
    """The wait after which every quota problem may have passed; None where one never passes (a quota of 0)."""
    waits = [wait for _, wait in problems]
    return None if None in waits else max(waits)


class SubmissionConflict(SubmissionError):
    """A submission that collides with jobs already in the table (their output folder, a job id); nothing of
    its batch was entered."""


def _shared_reason(error: SubmissionError, name: str) -> str:
    """The error's text with the job's own folder written `<...>/<job name>`: the same for every job of a jobs
    file whose output_dir the service refuses."""
    text = str(error)
    folder = error.folder
    if folder and folder.rstrip("/").endswith("/" + name):
        text = text.replace(folder, folder.rstrip("/")[:-len(name)] + "<job name>")
    return text


def _which(indices: list[int], submissions: list[JobSubmission], shown: int = 6) -> str:
    """'job 'a'', 'submission 2 of 3 (job 'b')' or 'submissions 1-4 of 4 (jobs 'a', 'b', 'c', 'd')'."""
    names = [f"'{submissions[i].job.name}'" for i in indices]
    if len(submissions) == 1:
        return f"job {names[0]}"
    if len(indices) == 1:
        return f"submission {indices[0] + 1} of {len(submissions)} (job {names[0]})"
    ranges, start = [], indices[0]
    for previous, current in zip(indices, [*indices[1:], None], strict=True):
        if current != previous + 1:
            ranges.append(f"{start + 1}" if start == previous else f"{start + 1}-{previous + 1}")
            start = current
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (f"submissions {', '.join(ranges)} of {len(submissions)} (jobs {', '.join(names[:shown])}{more})")


class Submissions:
    def __init__(self, table: JobTable, state_dir: Path, *, trainers: Sequence[TrainerConfig] = (),
                 output_root: Path | str | None = None,
                 statuses: Callable[[], Iterable[TrainerStatus]] = tuple, data_roots: Sequence[str] | None = None,
                 user_functions: Sequence[str] = ()):
        """`trainers`: the service's trainer kinds (a submission whose micro-batch no trainer of its base can
        step is refused). `output_root`: where submitted jobs may write, a path or a storage URI (None:
        anywhere the service can). `statuses`: the trainers' last reported statuses (a job whose adapter
        fits none of them is refused). `data_roots`: where jobs may read (None: an operator's and an admin's
        anywhere; a user's job only under these and their own roots); no job reads the state folder or
        another user's outputs. A user's job writes under `<output root>/<user>/`. `user_functions`: the functions
        (`module:function`, `module:*`) a user's job may name as a reward or metric besides the built-in ones."""
        self.table = table
        self.state_dir = Path(state_dir)
        self.trainer_configs = list(trainers)
        self.statuses = statuses
        self.output_root: Path | StorageURI | None = None
        if output_root is not None:
            root = as_location(output_root)
            self.output_root = root if isinstance(root, StorageURI) else root.expanduser().resolve()
        self.data_roots = None if data_roots is None else [as_root(root) for root in data_roots]
        self.user_functions = list(user_functions)
        self.users = UserBook.in_state_dir(self.state_dir)   # read again only when the file changes

    def submit_many(self, submissions: list[JobSubmission], job_ids: list[str] | None = None, *,
                    starts_over: bool = False) -> list[JobRecord]:
        """Enter jobs in the table together, all or none: every submission is checked first (the error
        names which one and why), then all are written in one transaction. The next decision round sees
        them all, so jobs submitted together (a jobs file) start together. `job_ids`: ids the client
        chose, so that a request repeated after a lost answer returns the jobs it entered the first time.
        A folder that holds another run's outputs and no job of the table wrote to is refused (`_outputs_there`)
        unless `starts_over`: the caller clears the jobs' folders before they start (`train_locally`)."""
        if job_ids is not None:
            if len(job_ids) != len(submissions) or len(set(job_ids)) != len(job_ids):
                raise SubmissionError(f"{len(job_ids)} job ids for {len(submissions)} submissions (or repeated ids)")
            bad = [job_id for job_id in job_ids if not JOB_ID.match(job_id)]
            if bad:
                raise SubmissionError(f"job ids {bad} are not letters, digits, '-' and '_' (at most 72)")
        ids = job_ids if job_ids is not None else [f"{s.job.name[:56]}-{uuid.uuid4().hex[:6]}" for s in submissions]
        submissions, chain_problems = chained(submissions, ids, self._entered_job)
        if job_ids is not None:
            existing = self._already_entered(submissions, job_ids)
            if existing is not None:
                return existing
        planned = self._planned(submissions, ids, chain_problems, starts_over=starts_over)
        with self.table.transaction():
            return [self.table.add(job_id, submission, output_dir) for job_id, submission, output_dir in planned]

    def check(self, submissions: list[JobSubmission]) -> None:
        """What `submit_many` checks (who may read the data, the output folders, the limits, the quotas), with
        nothing entered: SubmissionError (SubmissionConflict) as it would raise. The HTTP API asks before it
        reads the jobs' rows, so that a user's request reads no data outside where they may read."""
        ids = [f"{s.job.name[:56]}-{uuid.uuid4().hex[:6]}" for s in submissions]
        submissions, chain_problems = chained(submissions, ids, self._entered_job)
        self._planned(submissions, ids, chain_problems)

    def _planned(self, submissions: list[JobSubmission], ids: list[str], chain_problems: list[str | None], *,
                 starts_over: bool = False) -> list[tuple[str, JobSubmission, Path | StorageURI]]:
        """Each submission with its id and output folder, every one checked; SubmissionError naming each
        problem (SubmissionConflict where each is a collision with the table). `starts_over`: `submit_many`'s."""
        planned: list[tuple[str, JobSubmission, Path | StorageURI]] = []
        failed: dict[str, list[int]] = {}   # a reason -> the submissions it refuses, each told once
        conflicts = 0   # problems that are collisions with jobs in the table (SubmissionConflict)
        for index, submission in enumerate(submissions):
            name = submission.job.name
            job_id = ids[index]
            try:
                if chain_problems[index] is not None:
                    raise SubmissionError(chain_problems[index])
                if submission.job.method == "interactive":
                    raise SubmissionError("method interactive is a model of the Tinker API, created by its user's "
                                          "loop (create_lora_training_client; docs/tinker.md), never submitted")
                user = self._user(submission)
                self._check_data(submission, user)
                self._check_functions(submission, user)
                output_dir = self._output_dir(submission, job_id, self._root_of(user))
                self._check_limits(submission)
                other = (self.table.writing_to(output_dir, ACTIVE_STATES)   # or an ended job's results
                         or self.table.writing_to(output_dir, JOB_STATES))
                if other is not None:
                    raise SubmissionConflict(_folder_taken(other, output_dir))
                if not starts_over:
                    _outputs_there(output_dir)
                if any(output_dir == planned_dir for _, _, planned_dir in planned):
                    raise SubmissionError(f"two of the submitted jobs would write to {output_dir}; give this job "
                                          "another output_dir")
            except SubmissionError as error:
                failed.setdefault(_shared_reason(error, name), []).append(index)
                conflicts += isinstance(error, SubmissionConflict)
                continue
            planned.append((job_id, submission, output_dir))
        quota = self._quota_problems(submissions)
        problems = [text for text, _ in quota] + [
            f"{_which(indices, submissions)}: {reason}" for reason, indices in failed.items()]
        prefix = "nothing was submitted: " if len(submissions) > 1 else ""
        if quota and not failed:   # only a quota: the same batch passes later (429, Retry-After)
            raise QuotaExceeded(prefix + "; ".join(problems), retry_after=_longest(quota))
        if problems:   # a conflict where every problem is one (the caller may wait and submit again)
            only_conflicts = not quota and conflicts == sum(map(len, failed.values()))
            kind = SubmissionConflict if only_conflicts else SubmissionError
            raise kind(prefix + "; ".join(problems))
        return planned

    def folder_problem(self, submission: JobSubmission) -> str | None:
        """Why `submission`'s output_dir is no folder its submitter may write to (outside their output root, a
        storage URI where the root is a path, ...), or None; nothing is entered (a sweep asks before its trials)."""
        try:
            self._output_dir(submission, "check", self._root_of(self._user(submission)))
        except SubmissionError as error:
            return str(error)
        return None

    def _entered_job(self, key: str, submission: JobSubmission) -> tuple[str, JobSpec] | None:
        """A job entered before, by id or name, whose adapter `submission`'s submitter may start from (theirs; an
        operator's or an admin's: any): (its id, its spec), or None."""
        try:
            record = self.table.find(key)
        except KeyError:
            return None
        if submission.user is not None and record.user != submission.user:
            try:
                if not self.users.get(submission.user).admin:
                    return None
            except UserError:
                return None
        return record.id, self.table.submission(record.id).job

    def _already_entered(self, submissions: list[JobSubmission], job_ids: list[str]) -> list[JobRecord] | None:
        """The records of a batch entered before under these ids (a repeated request), or None if none was."""
        found = []
        for submission, job_id in zip(submissions, job_ids, strict=True):
            try:
                record = self.table.get(job_id)
            except KeyError:
                found.append(None)
                continue
            if not entered_as(self.table, self.table.submission(job_id), submission):
                raise SubmissionConflict(f"job id {job_id} is taken by another job; submit again (the client "
                                         "picks new ids)")
            found.append(record)
        if all(r is None for r in found):
            return None
        if any(r is None for r in found):
            raise SubmissionConflict(f"part of this batch was entered before ({[r.id for r in found if r]}), part "
                                     "not; check `aspen status` before submitting again")
        return found

    def _quota_problems(self, submissions: list[JobSubmission]) -> list[tuple[str, float | None]]:
        """Each user whose batch their quotas do not allow now, with when to try again (scheduler/quotas.py)."""
        return quota_problems(self.users, self.table.usage, submissions)

    def _user(self, submission: JobSubmission) -> User | None:
        """The submitting user's record (None: an operator, through Ray); an unknown user is refused."""
        if submission.user is None:
            return None
        try:
            return self.users.get(submission.user)
        except UserError:
            raise SubmissionError(f"'{submission.user}' is not a user of this service (no such name in "
                                  f"{self.state_dir / 'users.json'})") from None

    def check_reader(self, job: JobSpec, user: str) -> None:
        """SubmissionError where `user` is not a user of this service, `job`'s data is not theirs to read or it
        names a function they may not run."""
        submission = JobSubmission(job=job, user=user)
        self._check_data(submission, self._user(submission))
        self._check_functions(submission, self._user(submission))

    def check_requeue(self, submission: JobSubmission) -> None:
        """What queuing an entered job again (resume, extend) must pass, as its submission did but as things are
        now: its user is still a user, its data theirs to read, its functions theirs to run, and their quotas of
        queued jobs and daily tokens have room for it; SubmissionError naming what. An operator's job passes."""
        if submission.user is None:
            return
        user = self._user(submission)
        self._check_data(submission, user)
        self._check_functions(submission, user)
        self.check_quota([submission], f"job '{submission.job.name}' is not queued again: ")

    def check_quota(self, submissions: list[JobSubmission], prefix: str = "") -> None:
        """QuotaExceeded (`prefix`, then each quota and what frees it, with retry_after) where the submitters'
        quotas do not allow `submissions` now; nothing is entered (a new sweep asks for its first trial)."""
        problems = self._quota_problems(submissions)
        if problems:
            raise QuotaExceeded(prefix + "; ".join(text for text, _ in problems),
                                retry_after=_longest(problems))

    def _outputs(self) -> Path | StorageURI:
        return self.output_root or (self.state_dir / "outputs").resolve()

    @property
    def relative_root(self) -> Path | StorageURI | None:
        """What a relative output_dir is taken under (clients read it from `info()["output_root"]`): the output
        root; on a service with users but no configured root, the outputs folder their jobs write under
        (`<state>/outputs/<user>`); else None (a client resolves it from the jobs file's folder)."""
        return self.output_root or (self._outputs() if self.users.exists() else None)

    def _root_of(self, user: User | None) -> Path | StorageURI | None:
        """Where the job writes: a user's under `<output root>/<user>`; an operator's under the output root."""
        if user is None:
            return self.output_root
        outputs = self._outputs()
        return outputs / user.name

    def _check_data(self, submission: JobSubmission, user: User | None) -> None:
        """The job's data lies where it may read (actors/service/scheduler/data_roots.py)."""
        state = as_root(self.state_dir)   # its outputs (the default output root) are the outputs' rule's
        forbidden = [(state, f"the service's state folder {self.state_dir}", state / "outputs")]
        roots = self.data_roots
        if user is not None and not user.admin:
            roots = [*(self.data_roots or []), *(as_root(root) for root in user.data_roots)]
            outputs = self._outputs()
            forbidden.append((outputs, "the service's outputs other than yours", outputs / user.name))
        problem = data_problem(submission.job.data, roots, forbidden)
        if problem is not None:
            raise SubmissionError(problem)
        data = submission.job.data
        if user is not None and not is_uri(str(data)) and not Path(data).expanduser().exists():
            raise SubmissionError(f"data: file {data} does not exist on the service's machine")
        self._check_adapter(submission, user, roots, forbidden)

    def _check_adapter(self, submission: JobSubmission, user: User | None, roots: list[Location] | None,
                       forbidden: list[tuple[Location, str, Location | None]]) -> None:
        """The job's `init_adapter` lies where it may read (a user's own outputs too: a job of theirs that went
        before) and, where this machine has it, fits the job's lora (actors/spec/saved_adapter.py)."""
        adapter = submission.job.init_adapter
        if adapter is None or isinstance(adapter, JobAdapter):   # another job's: checked by `chained`
            return
        if roots is not None and user is not None:
            roots = [*roots, as_root(str(self._outputs() / user.name))]
        problem = data_problem(adapter, roots, forbidden, what="init_adapter")
        if problem is not None:
            raise SubmissionError(problem)
        if is_uri(str(adapter)):   # read (and checked) when the job starts
            return
        if not Path(adapter).expanduser().exists():
            if user is not None:
                raise SubmissionError(f"init_adapter: {adapter} does not exist on the service's machine")
            return   # an operator's: perhaps on the trainers' machines only; checked when the job starts
        try:
            check_adapter_config(adapter, submission.job.lora)
        except AdapterFileError as error:
            raise SubmissionError(str(error)) from None

    def _check_functions(self, submission: JobSubmission, user: User | None) -> None:
        """A user's job runs code of theirs on the trainers only where the operator allows it: its reward and
        generation metric are built in or among the service's `user_functions` (an operator's or admin's may name
        any). A reward or metric is called with texts the user controls (`builtins:exec` would run them)."""
        if user is None or user.admin:
            return
        for field, reference in submission.job.user_functions():
            if not allowed(reference, self.user_functions):
                shown = ", ".join(self.user_functions) or "none"
                raise SubmissionError(f"{field} '{reference}': a user's job may name only a built-in one or a function "
                                      f"this service allows (user_functions in its config: {shown}); ask an "
                                      "operator to allow it")

    def _output_dir(self, submission: JobSubmission, job_id: str,
                    root: Path | StorageURI | None) -> Path | StorageURI:
        """The job's folder under `root`: a resolved path, or a storage URI (its checkpoints and results are
        uploaded)."""
        if isinstance(root, StorageURI):
            return self._uri_output_dir(submission, job_id, root)
        if submission.output_dir is None:
            return ((root or self.state_dir / "outputs") / job_id).resolve()
        if is_uri(submission.output_dir):
            if root is not None:
                raise SubmissionError(f"output_dir {submission.output_dir} is outside this service's output root "
                                      f"{root}; leave output_dir out (the job gets {root}/<job id>) or give a path "
                                      f"under {root}", folder=str(submission.output_dir))
            return as_location(str(submission.output_dir))
        requested, under = Path(submission.output_dir).expanduser(), root or self.relative_root
        resolved = (under / requested if under is not None and not requested.is_absolute() else requested).resolve()
        if root is not None and not resolved.is_relative_to(root):
            raise SubmissionError(f"output_dir {resolved} is outside this service's output root {root}; jobs "
                                  "submitted to a shared service write only there: leave output_dir out (the job "
                                  f"gets {root}/<job id>) or give a path under {root}", folder=str(resolved))
        return resolved

    @staticmethod
    def _uri_output_dir(submission: JobSubmission, job_id: str, root: StorageURI) -> StorageURI:
        """A job's folder under a storage-URI output root: `<root>/<job id>`, `<root>/<relative output_dir>`,
        or a URI under the root."""
        requested = submission.output_dir
        if requested is None:
            return root / job_id
        if is_uri(requested):
            uri = StorageURI(str(requested).rstrip("/"))
        elif Path(requested).is_absolute() or ".." in Path(requested).parts:
            raise SubmissionError(f"output_dir {requested} is a path on this machine, but this service's output root "
                                  f"is {root}: leave output_dir out (the job gets {root}/<job id>) or give a folder "
                                  f"name relative to it (or a URI under {root})", folder=str(requested))
        else:
            uri = root / Path(requested).as_posix()
        if not uri.is_relative_to(root) or "/../" in f"{uri}/":
            raise SubmissionError(f"output_dir {uri} is outside this service's output root {root}; leave output_dir "
                                  f"out (the job gets {root}/<job id>) or give a URI under {root}", folder=str(uri))
        return uri

    def _check_limits(self, submission: JobSubmission) -> None:
        """Refuse what no trainer of the job's base could ever run: a micro-batch beyond every trainer's
        step, or an adapter that does not fit any trainer's memory budget next to the base and a step."""
        same_base = [t for t in self.trainer_configs
                     if t.base_model == submission.base_model and t.quantization == submission.quantization]
        statuses = [s for s in self.statuses()
                    if s.base_model == submission.base_model and s.quantization == submission.quantization]
        if same_base:
            # a step's tokens: as configured; `auto`'s floor until a trainer has planned its steps (its status)
            limits = ([step_tokens_floor(t.step_tokens) for t in same_base]
                      + [s.step_tokens for s in statuses if s.step_tokens])
            # unnamed: submit_many's message names the job already
            problems = [step_limit_problem(submission.job, tokens, named=False) for tokens in limits]
            if all(problems):
                raise SubmissionError(problems[0])
        views = [trainer_view(s) for s in statuses]
        if views:
            try:
                need = job_adapter_bytes(submission.job.lora, views[0], reference=submission.job.reference_adapter,
                                         keep_best=submission.job.keep_best is not None)
            except ValueError as error:   # target_modules that the base model does not have
                raise SubmissionError(str(error)) from None
            problem = never_fits(submission, need, views)
            if problem:
                raise SubmissionError(problem)


def _folder_taken(other: JobRecord, output_dir: Path | StorageURI) -> str:
    """Why a job may not write to `output_dir`, which `other` writes to or wrote its results to, and what to do."""
    if other.state in ACTIVE_STATES:
        return f"job {other.id} ({other.state}) already writes to {output_dir}; give this job another output_dir"
    again = ", resume that job (aspen resume)" if other.state in ("failed", "cancelled") else ""
    return (f"job {other.id} ({other.state}) wrote its results to {output_dir}, which this job would overwrite; give "
            f"this job another output_dir{again}, or forget that job (Client.delete: its files stay) and delete its "
            "files first")


def _outputs_there(output_dir: Path | StorageURI) -> None:
    """SubmissionConflict where `output_dir`, which no job of the table writes to or wrote to, holds a job's outputs
    (its adapter, checkpoint or metrics): another run's, copied or moved there, or those of a job forgotten since
    (actors/service/outputs/earlier_outputs.py). A storage URI that cannot be read from here (the scheduler's node may
    lack the credentials its trainers have) is logged and taken: the job's trainer checks it when the job starts."""
    try:
        found = earlier_outputs(output_dir)
    except StorageError as error:
        log.warning("%s was not looked into for an earlier run's outputs (%s); the job is entered and its trainer "
                    "checks the store when it starts", output_dir, error)
        return
    if found is not None:
        raise SubmissionConflict(
            f"{output_dir} holds the outputs of a job this service has no record of ({found.describe()}): copied or "
            "moved there, or left by a job forgotten since; this job would train over them. Give this job another "
            "output_dir (or none: the service gives it a new folder), or delete those files first to train it there")
