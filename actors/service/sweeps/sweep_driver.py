"""One sweep driven over a service's jobs, one `poll()` at a time (Ray-free: the scheduler runs it in its loop).

A poll starts the trials `actors/service/sweeps/sweep_run.py` says may start (at most `max_concurrent` at once: they
share fused steps with each other and any other job on the trainers), reads each running trial's progress
(its eval losses, its train losses with `objective: train_loss`, or its generation metric's scores), hands each
new objective to the sweep (successive halving, the forecast rule, the searcher) and cancels a trial it stops;
a trial's slot goes to the next one as soon as it ends. The sweep's state (its trials, the stopping rules'
records, the searcher's state and which job each trial is) is written to its state file after every change,
so a driver built again on that file (a restarted scheduler) carries on where it stopped: finished trials are
left alone, a trial whose job the service still has is followed again, a trial started but lost is started
again. A trial's job id is chosen, and written to the state file with the trial's settings, before its job is
entered, under that id: a service that dies at any point of starting a trial carries it on with the one job it
entered, or enters it then, under the same id and settings (never a second job, nor other settings); a trial's
stop is written before its job is cancelled, and the job of a stopped trial queued again by a restart (its stop lost
with the service's trainers) is cancelled again. An ended trial whose job its user continues (`aspen extend`
raises its max_steps, `aspen resume`) is followed again too, done sweep or not: its row says `continued` while its
job trains, and takes the objective and steps it ends with (`SweepRun.continued`)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Protocol

from actors.service.sweeps.sweep_run import CONTINUED, ENDED, HeldSearcher, SearcherNotRestored, SweepRun
from actors.spec.job_spec import JobSpec
from actors.spec.sweep_spec import SweepSpec
from actors.storage.durable import write_durably

ENDS = {"completed": "completed", "stopped_early": "completed", "failed": "failed", "cancelled": "cancelled"}


class SweepJobs(Protocol):
    """What a sweep needs of the service: the scheduler's own calls, or a client's."""

    def submit(self, job: JobSpec, *, job_id: str, base_model: str, seed: int, output_dir: str,
               user: str | None = None) -> str:
        ...   # the job entered under `job_id`; one entered under it before (the same job) answers with that one

    def folder_problem(self, job: JobSpec, *, base_model: str, seed: int, output_dir: str,
                       user: str | None = None) -> str | None:
        ...   # why a trial could not write to output_dir, asked before the sweep starts; None: it can

    def check_quota(self, job: JobSpec, *, base_model: str, seed: int, output_dir: str,
                    user: str | None = None) -> None:
        ...   # the service's quota refusal (QuotaExceeded) where `user`'s quotas refuse it now; asked before a sweep

    def status(self, job_id: str) -> Any: ...   # a JobRecord: state, step, reason

    def losses(self, job_id: str) -> list[dict[str, Any]]: ...

    def cancel(self, job_id: str, reason: str) -> None: ...

    def job_ids(self) -> set[str]: ...

    def moved(self, job_id: str, old_dir: str, new_dir: str) -> bool:
        ...   # an ended job's folder `old_dir` moving to `new_dir`: its record follows (False: it writes elsewhere)


class TrialWaits(Exception):
    """What `SweepJobs.submit` raises for a trial's job the service refuses only for now (its user's quota of queued
    jobs or daily tokens: actors/service/scheduler/quotas.py): the trial waits, pending, and is submitted again at
    each later poll; the sweep's status says why (`waiting`). `retry_after`: the service's hint, in seconds."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class SweepStateError(ValueError):
    """A sweep's state file cannot be carried on from (damaged, or from another sweep file)."""


class SweepDriver:
    def __init__(self, jobs: SweepJobs, spec: SweepSpec, state_path: Path, *, say=print, held: bool = False):
        """`held`: its searcher is not restored (a `HeldSearcher` instead: SweepBook's sweep held failed)."""
        self.jobs, self.spec, self.state_path, self.say = jobs, spec, Path(state_path), say
        self.job_ids: dict[str, str] = {}      # trial name -> the service's job id
        self.entering: dict[str, str] = {}     # trial name -> the job id chosen for it, its job perhaps not entered
        self.reported: dict[str, int] = {}     # trial name -> the last step handed to the sweep
        self.training_step: dict[str, int] = {}   # a running trial's job's step now (shown live; not saved)
        self.ended_jobs: set[str] = set()   # trials whose job was seen ended: one queued again is continued
        self.cancelled = False
        self.waiting: str | None = None   # why the next trials wait to be submitted (TrialWaits), None: none waits
        state = self._read_state()
        try:   # a cancelled sweep's searcher quiet from the start: one that raises (restoring too) ends it no less
            self.run = (SweepRun.restore(spec, state["run"], quiet=say if state.get("cancelled") else None,
                                         searcher=HeldSearcher() if held else None)
                        if state else SweepRun(spec))
        except SearcherNotRestored:
            raise
        except (ValueError, KeyError) as error:
            raise SweepStateError(f"{self.state_path}: {error}") from None
        if state:
            self.job_ids, self.reported = dict(state["job_ids"]), dict(state["reported"])
            self.cancelled = bool(state.get("cancelled"))
            self.ended_jobs = set(state.get("ended_jobs", ()))
            self.entering = dict(state.get("entering", {}))
            self._readopt()

    def _read_state(self) -> dict | None:
        if not self.state_path.exists():
            return None
        try:
            return json.loads(self.state_path.read_text())["driver"]
        except (ValueError, KeyError) as error:
            raise SweepStateError(f"{self.state_path}: not a sweep's state ({error}); move it away to start the "
                                  "sweep afresh") from None

    def _readopt(self) -> None:
        """After a restart: a trial being started whose job was entered is followed, one whose job was not is
        entered at the next poll (under the id chosen for it); a running trial whose job the service no longer has
        starts again; a continued one ends cancelled (the sweep's part of it ended before)."""
        known = self.jobs.job_ids()
        for name, job_id in list(self.entering.items()):
            trial = self.run.trials[name]
            if job_id in known and trial.state in ("pending", "running"):
                self.job_ids[name], trial.state = self.entering.pop(name), "running"
            elif trial.state == "running":
                trial.state = "pending"
        for name, trial in self.run.trials.items():
            if trial.state == CONTINUED and self.job_ids.get(name) not in known:
                self.run.ended(name, "cancelled", trial.steps, "its job, continued after it ended, is no longer in "
                                                               "the service")
            elif trial.state == "running" and self.job_ids.get(name) not in known:
                trial.state = "pending"
                self.job_ids.pop(name, None)
                self.reported.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"run": self.run.state_dict(), "job_ids": self.job_ids, "reported": self.reported,
                "cancelled": self.cancelled, "ended_jobs": sorted(self.ended_jobs), "entering": self.entering}

    def save(self) -> None:
        """The spec and the state, written whole and durably (`durable.write_durably`)."""
        write_durably(self.state_path, json.dumps({"spec": self.spec.model_dump(mode="json"),
                                                   "driver": self.state_dict()}, indent=1))

    @property
    def done(self) -> bool:
        return self.run.done or (self.cancelled and not self.running_jobs())

    def running_jobs(self) -> list[str]:
        return [self.job_ids[n] for n, t in self.run.trials.items() if t.state == "running" and n in self.job_ids]

    def poll(self) -> bool:
        """Start what may start, hand new objectives to the sweep, cancel what it stops, note what ended.
        True once every trial has ended. The state is written only when something changed (the scheduler
        polls every tick; a searcher's state is a pickle)."""
        before = self._marker()
        if not self.cancelled:
            self._start(self.run.to_start())
        for name, trial in self.run.trials.items():
            if name not in self.job_ids:
                continue
            if trial.state in ENDED:
                self._follow_ended(name)
            if trial.state not in ("running", CONTINUED):
                continue
            job_id = self.job_ids[name]
            record = self.jobs.status(job_id)   # before its losses: a job that ended has them all written
            live = record.state not in ENDS
            self.training_step[name] = record.step
            for step, objective in self._objectives(job_id):
                if step <= self.reported.get(name, 0):
                    continue
                self.reported[name] = step
                if trial.state == CONTINUED:
                    self.run.report_continued(name, step, objective)
                    continue
                decision = self.run.report(name, step, objective, live=live)
                if trial.state == "stopped":
                    try:
                        self.save()   # noted before its job is cancelled: a restart cancels it again
                    finally:          # a state not written fails the sweep; the stop is still made
                        self._cancel(job_id, f"stopped by sweep '{self.spec.name}': "
                                             f"{decision.reason if decision else trial.stopped_because}")
                    self.say(f"{name}: stopped at step {step}: {trial.stopped_because}")
                    break
            if trial.state in ("running", CONTINUED) and record.state in ENDS:
                self.ended_jobs.add(name)
                self.run.ended(name, ENDS[record.state], record.step, record.reason)
                self.say(f"{name}: {trial.state} at step {record.step}"
                         + (f", objective {trial.objective:.4f}" if trial.objective is not None else ""))
        if self._marker() != before:
            self.save()
        return self.done

    def _follow_ended(self, name: str) -> None:
        """An ended trial's job: noted once it has ended (a stopped trial's job ends when its cancel lands), and the
        trial continued where its job is queued or trains again after that (its user extended or resumed it). A
        stopped trial's job queued before it was seen ended lost its cancel with the service (queued again when
        the service started again): cancelled now."""
        try:
            record = self.jobs.status(self.job_ids[name])
        except KeyError:   # its job was deleted: its row stays as the trial ended
            return
        trial = self.run.trials[name]
        if record.state in ENDS:
            self.ended_jobs.add(name)
        elif trial.state == "stopped" and name not in self.ended_jobs and record.state == "queued":
            self._cancel(self.job_ids[name], f"stopped by sweep '{self.spec.name}': {trial.stopped_because}")
        elif name in self.ended_jobs:
            self.run.continued(name)
            self.say(f"{name}: continued from step {self.run.trials[name].steps} ({record.reason or record.state})")

    def _start(self, starting: list[JobSpec]) -> None:
        """Submit the trials' jobs, each under the job id chosen for it and written to the state file first
        (`_readopt`: a restart finds its job, or enters it then, never a second one). One the service refuses (its
        settings: a rank whose adapter fits no trainer's memory, a micro-batch beyond every step) fails alone, saying
        why, and the sweep goes on. One its user's quota refuses for now (TrialWaits) is not lost: it and the later
        ones go back to pending, `waiting` says why, and the next polls submit them again (under the same ids) until
        the quota lets them in. On any other error (the state file not written: nothing is entered) the trials not yet
        submitted go back to pending (not shown running with no job) and the error is raised."""
        fresh = [job.name for job in starting if job.name not in self.entering]
        self.entering.update({name: f"{name[:56]}-{uuid.uuid4().hex[:6]}" for name in fresh})
        if fresh:   # the new trials' ids, settings and searcher state on disk before their jobs are entered
            try:
                self.save()
            except Exception:
                for job in starting:
                    self.run.trials[job.name].state = "pending"
                    if job.name in fresh:
                        del self.entering[job.name]
                raise
        for index, job in enumerate(starting):
            try:
                self.job_ids[job.name] = self.jobs.submit(job, job_id=self.entering[job.name],
                                                          base_model=self.spec.base_model, seed=self.spec.seed,
                                                          output_dir=str(Path(self.spec.output_dir) / job.name),
                                                          user=self.spec.user)
                del self.entering[job.name]
                self.waiting = None
            except TrialWaits as wait:   # its user's quota: it and the trials after it wait, tried again next poll
                for later in starting[index:]:
                    self.run.trials[later.name].state = "pending"
                if self.waiting != f"{job.name}: {wait}":
                    self.waiting = f"{job.name}: {wait}"
                    self.say(f"{job.name}: waits to be submitted (tried again as the sweep goes on): {wait}")
                return
            except ValueError as error:   # the service's refusal of this trial's job (SubmissionError)
                del self.entering[job.name]
                self.run.ended(job.name, "failed", 0, f"the service refused its job: {error}")
                self.say(f"{job.name}: failed: the service refused its job: {error}")
            except Exception:
                for later in starting[index:]:
                    self.run.trials[later.name].state = "pending"
                raise

    def leaderboard(self) -> dict[str, Any]:
        """The run's leaderboard, each running (or continued) trial with its job's step now (`steps`: between the
        objectives it reports, a trial trains on)."""
        board = self.run.leaderboard()
        for trial in board["trials"]:
            if trial["state"] in ("running", CONTINUED):
                trial["steps"] = max(trial["steps"], self.training_step.get(trial["name"], 0))
        return board

    def _marker(self) -> tuple:
        """What a poll can change: the trials' jobs, the steps handed on, each trial's state and steps (the
        searcher and the stopping rules change only with these)."""
        return (tuple(self.job_ids.items()), tuple(self.entering.items()), tuple(self.reported.items()),
                self.cancelled, len(self.ended_jobs),
                tuple((name, t.state, t.steps) for name, t in self.run.trials.items()))

    def cancel(self, reason: str) -> list[str]:
        """Start no more trials and cancel the running ones and those its user continued after they ended (`aspen
        extend`, `aspen resume`: the trial's job trains again); each ends `cancelled` (a continued one keeps its
        `continued_from`) as the next polls see its job end. It always ends the sweep: what went wrong meanwhile (the
        searcher raising as it hears how the trials ended, a job that cannot be cancelled) is logged and answered."""
        self.cancelled = True
        self.waiting = None
        problems = self.run.quiet(self.say)   # a searcher that raised (a failed sweep's) raises no more
        for name, trial in self.run.trials.items():
            if trial.state == "pending":
                self.entering.pop(name, None)
                self.run.ended(name, "cancelled", trial.steps, reason)
            elif trial.state in ENDED and name in self.job_ids:   # continued since the last poll: seen now
                try:
                    self._follow_ended(name)
                except Exception as error:  # noqa: BLE001 - the service's answer about its job: the rest goes on
                    problems.append(f"{name}: {type(error).__name__}: {error}")
        continued = [self.job_ids[n] for n, t in self.run.trials.items() if t.state == CONTINUED and n in self.job_ids]
        for job_id in [*self.running_jobs(), *continued]:
            try:
                self._cancel(job_id, reason)
            except Exception as error:  # noqa: BLE001 - one job's: the others are cancelled still
                problems.append(f"job {job_id} not cancelled: {type(error).__name__}: {error}")
                self.say(problems[-1])
        self.save()
        return problems

    def _cancel(self, job_id: str, reason: str) -> None:
        """Cancel a trial's job; one that ended meanwhile (its last steps ran between two looks) has nothing
        left to stop."""
        if self.jobs.status(job_id).state not in ENDS:
            try:
                self.jobs.cancel(job_id, reason)
            except ValueError as error:   # it ended between the look and the cancel
                if "already ended" not in str(error):
                    raise

    def _objectives(self, job_id: str) -> list[tuple[int, float]]:
        rows = self.jobs.losses(job_id)
        column = self.spec.objective_column
        return sorted((int(row["step"]), float(row[column])) for row in rows if row.get(column) is not None)

    def curves(self) -> dict[str, list[tuple[int, float]]]:
        """Each started trial's objectives by step (for the report)."""
        return {name: self._objectives(job_id) for name, job_id in self.job_ids.items()}
