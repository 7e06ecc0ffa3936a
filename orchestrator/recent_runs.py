"""The runs `aspen run` started on this machine (`~/.aspen/runs.json`, or
$ASPEN_RECENT_RUNS; newest first): where each keeps its job
table and outputs, so that `aspen status` and `aspen export` answer from a run's own folder once its service
has ended, as the natural next commands after a run (`RecentRuns.find`, `offline_jobs`)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from actors.storage.durable import write_durably

log = logging.getLogger(__name__)

KEPT = 20   # the newest runs remembered
DEFAULT_PATH = "~/.aspen/runs.json"


@dataclass(frozen=True)
class RecentRun:
    jobs_file: str      # as given to `aspen run`, absolute
    output_dir: str     # the run's output folder (or storage URI)
    state_dir: str      # the folder of its job table (jobs.sqlite)
    started_at: float
    sweep: str | None = None   # a sweep's name (`aspen sweep FILE`): its leaderboard is in output_dir

    @property
    def table(self) -> Path:
        return Path(self.state_dir) / "jobs.sqlite"


class RecentRuns:
    """The list in `path`; reading never fails a command (an unreadable file is an empty list, logged)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path or os.environ.get("ASPEN_RECENT_RUNS") or DEFAULT_PATH).expanduser()

    def all(self) -> list[RecentRun]:
        try:
            rows = json.loads(self.path.read_text())
            return [RecentRun(**row) for row in rows]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError) as error:
            log.warning("%s cannot be read (%s): the runs started before are not looked up", self.path, error)
            return []

    def remember(self, jobs_file: str | Path, output_dir: str, state_dir: str | Path, *,
                 sweep: str | None = None) -> None:
        """Put a run first (once: the same output folder again moves it up)."""
        run = RecentRun(str(Path(jobs_file).absolute()), str(output_dir), str(Path(state_dir).absolute()),
                        round(time.time(), 3), sweep)
        runs = [run] + [r for r in self.all() if r.output_dir != run.output_dir]
        try:
            write_durably(self.path, json.dumps([asdict(r) for r in runs[:KEPT]], indent=1) + "\n", private=True)
        except OSError as error:   # a run is not stopped for its bookmark
            log.warning("cannot write %s (%s): `aspen status` will not find this run once it ended", self.path, error)

    def latest(self) -> RecentRun | None:
        """The newest run whose job table is still there."""
        return next((run for run in self.all() if run.table.is_file()), None)

    def find_sweep(self, name: str) -> RecentRun | None:
        """The newest sweep of this name whose folder is still here."""
        return next((run for run in self.all() if run.sweep == name and Path(run.output_dir).is_dir()), None)

    def find(self, job: str) -> RecentRun | None:
        """The newest run with a job of this id or name."""
        from actors.service.table.job_table import read_jobs

        for run in self.all():
            records = read_jobs(run.table) or []
            if any(job in (record.id, record.name) for record, _ in records):
                return run
        return None


def shown_folder(state_dir: str | Path) -> Path:
    """The folder a user names for a run: its output folder where the table is in its .aspen folder."""
    folder = Path(state_dir)
    return folder.parent if folder.name == ".aspen" else folder


def where_else(error: KeyError, job: str) -> KeyError:
    """A running service's "no job" error, with where the job is when a run this machine started has it in its
    table (a user asking the service for a job of an `aspen run` that has ended, or runs on its own cluster)."""
    run = RecentRuns().find(job)
    if run is None:
        return error
    folder = shown_folder(run.state_dir)
    return KeyError(f"{error.args[0] if error.args else error} on the running service; the run in {folder} has a job "
                    f"'{job}' in its table: add --from {folder}")


def offline_jobs(state_dir: str | Path) -> list:
    """The job records of a run's table (`<state_dir>/jobs.sqlite`), read without a service; [] without one."""
    from actors.service.table.job_table import read_jobs

    return [record for record, _ in read_jobs(Path(state_dir) / "jobs.sqlite") or []]


class EndedRun:
    """The calls of `aspen status`, `aspen losses` and `aspen generations` (`jobs`, `status`, `transitions`,
    `losses`, `generations`) answered from a
    run's job table after its service ended: read-only (nothing is created, repaired or locked)."""

    def __init__(self, state_dir: str | Path):
        self.table = Path(state_dir) / "jobs.sqlite"
        if not self.table.is_file():
            raise FileNotFoundError(f"{state_dir}: no job table (jobs.sqlite) there; give a run's output folder or "
                                    "its .aspen folder")

    def jobs(self) -> list:
        return offline_jobs(self.table.parent)

    def status(self, key: str):
        records = self.jobs()
        found = [r for r in records if r.id == key] or [r for r in records if r.name == key]
        if not found and (state_folder(key) / "jobs.sqlite").is_file():   # a run's folder where a job was asked
            raise KeyError(f"'{key}' is a run's folder, not a job: give it as --from {key}")
        if len(found) != 1:
            raise KeyError(f"no job with id or name '{key}' in {self.table}" if not found else
                           f"{len(found)} jobs are named '{key}' ({', '.join(r.id for r in found)}); give the job id")
        return found[0]

    def transitions(self, job_id: str) -> list[tuple[float, str, str]]:
        return self._read("SELECT time, state, reason FROM transitions WHERE job_id = ? ORDER BY rowid", (job_id,))

    def losses(self, key: str) -> list[dict]:
        """The job's progress rows (`aspen losses`), as the running service answers them."""
        import sqlite3

        from actors.service.table.progress_rows import progress_of

        job_id = self.status(key).id
        db = sqlite3.connect(f"{self.table.absolute().as_uri()}?mode=ro", uri=True)
        try:
            return progress_of(db, job_id)
        finally:
            db.close()

    def generations(self, key: str, step: int | None = None) -> dict:
        """The job's eval_generate evaluation (`aspen generations`) from its folder, as the running service's."""
        from actors.service.outputs.job_files import job_generations

        return job_generations(self.status(key), step)

    def _read(self, query: str, parameters: tuple) -> list[tuple]:
        import sqlite3

        db = sqlite3.connect(f"{self.table.absolute().as_uri()}?mode=ro", uri=True)
        try:
            return list(db.execute(query, parameters))
        finally:
            db.close()


def state_folder(run_dir: str | Path) -> Path:
    """A run's job-table folder from what a user gives: the run's output folder, or its .aspen folder."""
    folder = Path(run_dir).expanduser()
    return folder / ".aspen" if (folder / ".aspen" / "jobs.sqlite").is_file() else folder
