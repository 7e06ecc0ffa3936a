"""A failed or cancelled sweep that a sweep of the same name and other settings replaces (SweepBook.add).

Its trials are jobs of the service that wrote to `<output_dir>/<trial>/`, the folders the new sweep's trials of the
same names train in; the service refuses a job a folder an ended job wrote its results to (it would overwrite an
adapter its user may still want). So, where the new sweep writes to the same `output_dir`, the old sweep's results
are set aside, not overwritten: its trials' folders, `report.png` and its leaderboard (with each trial's job id and how
the sweep ended) move to `<output_dir>/replaced-<k>/` (the first free k), and its jobs' output_dir in the job table
with them (`aspen export`, `aspen resume` and `aspen status` find them there). A replacement cut short (the service
killed mid-way) is finished by the next: the folder whose leaderboard names the same jobs is taken again. A sweep in
another `output_dir` leaves the old one's folder as it is. Its trials' jobs that wait (queued, or held paused when
its service stopped) are cancelled, their checkpoints moved with them; a replacement while one of its trials' jobs
trains (a failed sweep follows none; one its user continued) is refused: `blocking_jobs` names them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from actors.service.sweeps.sweep_driver import ENDS, SweepDriver
from actors.storage.durable import fsync_path, replace_durably, write_durably

log = logging.getLogger(__name__)
REPLACED_PREFIX = "replaced-"


def trial_jobs(driver: SweepDriver) -> dict[str, str]:
    """Each trial of the sweep that has (or was about to have) a job: its job id."""
    return {**driver.entering, **driver.job_ids}


def blocking_jobs(driver: SweepDriver) -> list[str]:
    """The sweep's trials' jobs that train now ("qa-t0-1a2b3c (running)"): a replacement waits for them to end
    (their folders are being written). Queued and paused ones are not: the replacement cancels them."""
    blocking = []
    for job_id in trial_jobs(driver).values():
        try:
            state = driver.jobs.status(job_id).state
        except KeyError:   # never entered, or deleted since
            continue
        if state == "running":
            blocking.append(f"{job_id} ({state})")
    return blocking


def set_aside(old: SweepDriver, state: str, new_output_dir: str) -> dict[str, Any] | None:
    """The old sweep's results moved out of the new sweep's way (its folder `<output_dir>/replaced-<k>/`, its jobs'
    output_dir with them) and its trials' jobs that wait (queued, or held paused) cancelled, their checkpoints moved
    with their folders (`aspen resume` continues them there); what was done (`{"name", "state", "folder", "jobs",
    "cancelled"}`), or None where the new sweep writes elsewhere (nothing moves or is cancelled: the old results stay
    in the old output_dir)."""
    source = Path(old.spec.output_dir)
    if Path(new_output_dir) != source:
        return None
    jobs = trial_jobs(old)
    target = _target(source, jobs)
    target.mkdir(parents=True, exist_ok=True)
    reason = f"sweep '{old.spec.name}' ({state}) was replaced by one of other settings; its folder moved to {target}"
    cancelled = _cancel_waiting(old, jobs, reason)
    board = {"name": old.spec.name, **_final_board(old, jobs, reason),
             "replaced": {"state": state, "at": time.time(), "jobs": jobs, "output_dir": str(source)}}
    write_durably(target / "leaderboard.json", json.dumps(board, indent=1))   # first: names the jobs (`_target`)
    for name in old.run.trials:
        folder = source / name
        job_id = jobs.get(name)
        # the table first: a job is never left pointing at a folder another trial takes; a folder that is not its
        # job's (the job wrote elsewhere) is left where it is (the new trial's submission says whose it is)
        if job_id is not None and not old.jobs.moved(job_id, str(folder), str(target / name)):
            continue
        if folder.exists() and not (target / name).exists():
            replace_durably(folder, target / name)
    if (source / "report.png").exists():
        replace_durably(source / "report.png", target / "report.png")
    (source / "leaderboard.json").unlink(missing_ok=True)   # the old one's, rewritten above in `target`
    fsync_path(source)
    log.info("sweeps: %s", reason)
    return {"name": old.spec.name, "state": state, "folder": str(target), "jobs": jobs, "cancelled": cancelled}


def _cancel_waiting(old: SweepDriver, jobs: dict[str, str], reason: str) -> list[str]:
    """The old trials' jobs that are queued or paused (held when its service stopped), cancelled now."""
    cancelled = []
    for job_id in jobs.values():
        try:
            waiting = old.jobs.status(job_id).state in ("queued", "paused")
        except KeyError:
            continue
        if waiting:
            old.jobs.cancel(job_id, f"{reason} (aspen resume {job_id} continues it from its checkpoint there)")
            cancelled.append(job_id)
    return cancelled


def _final_board(old: SweepDriver, jobs: dict[str, str], reason: str) -> dict[str, Any]:
    """The old sweep's leaderboard as it ends: a trial it had not seen end (a failed sweep follows none) as its job
    ended, one without a job (pending, never entered) cancelled. The searcher is not told (a failed sweep's may be
    what raised)."""
    board = old.run.leaderboard()
    for row in board["trials"]:
        if row["state"] not in ("pending", "running", "continued"):
            continue
        try:
            record = old.jobs.status(jobs[row["name"]])
        except KeyError:
            record = None
        ended = ENDS.get(record.state) if record is not None else None
        row["state"] = ended or "cancelled"
        row["steps"] = max(row["steps"], record.step) if record is not None else row["steps"]
        if row["state"] != "completed":
            row["stopped_because"] = (record.reason if ended and record.reason else reason)
    return board


def _target(source: Path, jobs: dict[str, str]) -> Path:
    """`replaced-<k>` under `source`: the one an interrupted replacement of the same sweep began (its leaderboard
    names the same jobs), else the first free k."""
    k = 1
    while (source / f"{REPLACED_PREFIX}{k}").exists():
        try:
            begun = json.loads((source / f"{REPLACED_PREFIX}{k}" / "leaderboard.json").read_text())["replaced"]
        except (OSError, ValueError, KeyError, TypeError):
            begun = None
        if begun is not None and begun.get("jobs") == jobs:
            break
        k += 1
    return source / f"{REPLACED_PREFIX}{k}"
