"""A run's jobs kept in a run folder's job table: `aspen run --in-process` trains with a table of its own and, as
it ends, records its jobs (their rows, progress and history) in `<output_dir>/.aspen/jobs.sqlite`, the table
`aspen run` keeps there, in place of the jobs that wrote to the same folders before. So `aspen report`, `aspen
status` and `aspen run` itself read an in-process run as they read one of the service's; a job it left
unfinished is recorded paused, and `aspen run` resumes it from its checkpoint. The run records its jobs as they
start too, so that a run killed on the way (SIGKILL, a second Ctrl-C) leaves no earlier run's record of their
folders (a job done there before) in the table. Run again on that folder, it carries on the jobs `aspen run`'s plan
says to keep (`carry_on`: their rows copied into the new run's table, the unfinished ones resumed from their
checkpoints), as `aspen run` does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.service.table.job_record import unreported_resume_point
from actors.service.table.job_table import TERMINAL_STATES, JobRecord, JobTable
from actors.spec.job_submission import JobSubmission

# the tables holding a job's rows, and the column naming the job in each
JOB_ROWS = (("jobs", "id"), ("progress", "job_id"), ("transitions", "job_id"))
UNFINISHED_REASON = "left by an in-process run ({reason})"   # `aspen run` resumes it from its checkpoint
# an unfinished job of a run that stopped (Ctrl-C, SIGTERM), in process or through its service: held paused, alike
HELD_REASON = "held: its run stopped before it ended (Ctrl-C, SIGTERM); "   # what `aspen sweep` resumes again
RUN_CONTINUES = "the same `aspen run` command continues it from {step}"
STOPPED_RUN_REASON = HELD_REASON + RUN_CONTINUES


def stopped_run_reason(record: JobRecord, continues: str = RUN_CONTINUES) -> str:
    """Why an unfinished job of a stopped run is paused, and what continues it (the same words in process and
    through a service; `continues` names the command, `{step}` where it resumes from)."""
    return HELD_REASON + continues.format(step=unreported_resume_point(record.checkpoint_step))


def hold_unfinished(table: JobTable, skip: Callable[[str], bool] = lambda job_id: False,
                    continues: str = RUN_CONTINUES) -> list[str]:
    """A stopped run's queued and running jobs (but those `skip` names) paused, with no trainer, saying what
    continues them (`stopped_run_reason`); their ids. `aspen run`'s (`aspen sweep`'s, `aspen demo`'s) service as it
    stops, as its in-process run ends."""
    held = []
    with table.transaction():
        for record in table.all(("queued", "running")):
            if not skip(record.id):
                table.set_state(record.id, "paused", stopped_run_reason(record, continues), trainer=None)
                held.append(record.id)
    return held


@dataclass
class CarriedJobs:
    """Jobs of the run folder's table a new run carries on, by their ids there (`aspen run`'s plan)."""
    done: list[str] = field(default_factory=list)     # ended with the same spec: left alone
    resume: list[str] = field(default_factory=list)   # unfinished with the same spec: resumed from their checkpoints
    extend: dict[str, JobSubmission] = field(default_factory=dict)   # max_steps raised: the new spec, continued


def record_run(source: JobTable, job_ids: list[str], path: Path,
               unfinished: Callable[[JobRecord], str] | None = None) -> None:
    """Keep `job_ids` of `source` in the job table at `path` (created where there is none), in one transaction:
    first the jobs there that wrote to the same folders, or have the same ids, are forgotten (the run started them
    over); then each job's rows are copied by column name (an older table's added columns sit elsewhere).
    Unfinished jobs are recorded paused, with no trainer (that process's trainer is gone), `unfinished` saying why
    (by default: left by an in-process run, with the reason they had)."""
    if not job_ids:
        return
    records = [source.get(job_id) for job_id in job_ids]
    folders = {record.output_dir for record in records}
    target = JobTable(path)
    try:
        with target.transaction():
            for earlier in target.all():
                if earlier.output_dir in folders or earlier.id in job_ids:
                    target.delete(earlier.id)
            _copy_rows(source, target, job_ids)
            for record in records:
                if record.state not in TERMINAL_STATES:
                    reason = (UNFINISHED_REASON.format(reason=record.reason or record.state) if unfinished is None
                              else unfinished(record))
                    target.set_state(record.id, "paused", reason, trainer=None)
    finally:
        target.close()


def earlier_jobs(path: Path) -> list[tuple[JobRecord, JobSubmission]]:
    """Every job the run folder's table at `path` holds, with its submission; none where there is no table. Opened
    as a service opens it (a killed run's write-ahead log written back); a damaged one raises `JobTableDamaged`,
    whose message says how to restore its backup."""
    if not path.is_file():
        return []
    table = JobTable(path)
    try:
        return [(record, table.submission(record.id)) for record in table.all()]
    finally:
        table.close()


def carry_on(path: Path, target: JobTable, carried: CarriedJobs, reason: str) -> None:
    """The carried jobs of the run folder's table at `path` copied into `target`, a new run's table, in one
    transaction: the done ones as they are (and those whose budget is raised: `SchedulerCore.extend` queues them
    next), the others queued to resume from their checkpoints (`reason` says by what), as `aspen run` resumes them."""
    if not (carried.done or carried.resume or carried.extend):
        return
    source = JobTable(path)
    try:
        with target.transaction():
            _copy_rows(source, target, [*carried.done, *carried.resume, *carried.extend])
            for job_id in carried.resume:
                record = target.get(job_id)
                step = f"its checkpoint at step {record.checkpoint_step}" if record.checkpoint_step else "the start"
                target.set_state(job_id, "queued", f"{reason}; resumes from {step}", trainer=None)
    finally:
        source.close()


def _copy_rows(source: JobTable, target: JobTable, job_ids: list[str]) -> None:
    """Each job's rows of `source` inserted into `target`, by column name (an older table's added columns sit
    elsewhere; a column the target lacks would fail the insert), inside the caller's transaction."""
    marks = ", ".join("?" * len(job_ids))
    for table, key in JOB_ROWS:
        names = [row[1] for row in source.db.execute(f"PRAGMA table_info({table})")]
        columns, places = ", ".join(names), ", ".join("?" * len(names))
        rows = source.db.execute(f"SELECT {columns} FROM {table} WHERE {key} IN ({marks})", job_ids).fetchall()
        if rows:
            target.db.executemany(f"INSERT INTO {table} ({columns}) VALUES ({places})", rows)
