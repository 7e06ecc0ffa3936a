"""`aspen sweep FILE`: a sweep's trials trained as ordinary jobs of a service, weak ones stopped early.

The driver submits the trials `actors/service/sweep_run.py` says may start (at most `max_concurrent` at once:
they share fused steps with each other and any other job on the trainers), reads each running trial's
progress from the service (its eval losses, or its train losses with `objective: train_loss`), hands each
new objective to the sweep's successive halving and cancels a trial it stops; a trial's slot goes to the
next one as soon as it ends. The sweep's state (its trials' states, objectives and the halving's records, and
which job each trial is) is written to `<output_dir>/sweep.json` after every change, so running the same
file again carries on where it stopped: finished trials are left alone, a trial whose job the service still
has is followed again, a trial started but lost is started again. The leaderboard ends it
(`<output_dir>/leaderboard.json`, and printed).

Each trial's settings come from the sweep's searcher when its slot opens (random, grid, or a Ray Tune
searcher such as Optuna: policies/searchers.py), which hears every trial's objectives; its state is part of
sweep.json, so a re-run asks the same searcher. Issue 34, not yet here: generation objectives,
`POST /v1/sweeps`, the sweep inside the scheduler (so that it outlives this driver), report.png, the metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from actors.engine.spec import RunSpec
from actors.engine.storage import is_uri
from actors.engine.sweep_spec import SweepSpec
from actors.service.sweep_run import SweepRun
from orchestrator.jobs_file import FILE_LIMITS, SpecError
from orchestrator.spec_text import TooComplex, load_yaml
from policies.searchers import BUILT_IN, build_searcher

STATE_FILE = "sweep.json"
LEADERBOARD_FILE = "leaderboard.json"
ENDS = {"completed": "completed", "stopped_early": "completed", "failed": "failed", "cancelled": "cancelled"}


def load_sweep_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep file; the job's data and the output folder are relative to the file's folder.
    Errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    try:
        data = load_yaml(path.read_text(), FILE_LIMITS)
    except TooComplex as error:
        raise SpecError(f"{path}: {error}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping with name, job, space, ... at the top level")
    data = dict(data)
    job = data.get("job")
    if isinstance(job, dict) and isinstance(job.get("data"), str) and "://" not in job["data"]:
        data["job"] = {**job, "data": str((path.parent / job["data"]).resolve())}
    if isinstance(data.get("output_dir"), str) and "://" not in data["output_dir"]:
        data["output_dir"] = str((path.parent / data["output_dir"]).resolve())
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as error:
        problems = []
        for problem in error.errors():
            where = ".".join(str(part) for part in problem["loc"])
            message = problem["msg"].removeprefix("Value error, ")
            problems.append(f"{path}: {where + ': ' if where else ''}{message}")
        raise SpecError("\n".join(problems)) from None
    if spec.search not in BUILT_IN:   # a searcher that cannot be built (not installed, bad options): now
        try:
            build_searcher(spec.search, spec.parsed_space(), trials=spec.trials, seed=spec.seed,
                           options=spec.search_options)
        except ValueError as error:
            raise SpecError(f"{path}: {error}") from None
    return spec


def service_run_spec(spec: SweepSpec) -> RunSpec:
    """The run a sweep's own service is configured from (`run_service_config`): its base model and step budget."""
    return RunSpec(base_model=spec.base_model, output_dir=spec.output_dir, step_tokens=spec.step_tokens,
                   seed=spec.seed, jobs=[spec.job])


class SweepDriver:
    """Drives one sweep through a `Client` (`orchestrator.client`), one `poll()` at a time."""

    def __init__(self, client: Any, spec: SweepSpec, folder: Path):
        if is_uri(spec.output_dir):
            raise SpecError(f"sweep '{spec.name}': output_dir {spec.output_dir} is a storage URI; a sweep's folder "
                            "(its state, its trials' adapters) is a local path for now")
        self.client, self.spec, self.folder = client, spec, folder
        self.job_ids: dict[str, str] = {}      # trial name -> the service's job id
        self.reported: dict[str, int] = {}     # trial name -> the last step handed to the sweep
        state = self._read_state()
        try:
            self.run = SweepRun.restore(spec, state["run"]) if state else SweepRun(spec)
        except (ValueError, KeyError) as error:
            raise SpecError(f"{folder / STATE_FILE}: {error}") from None
        if state:
            self.job_ids, self.reported = dict(state["job_ids"]), dict(state["reported"])
            self._readopt()

    def _read_state(self) -> dict | None:
        path = self.folder / STATE_FILE
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as error:
            raise SpecError(f"{path}: not a sweep's state ({error}); move it away to start the sweep afresh") from None

    def _readopt(self) -> None:
        """After a restart: a running trial whose job the service no longer has starts again."""
        known = {record.id for record in self.client.jobs()}
        for name, trial in self.run.trials.items():
            if trial.state == "running" and self.job_ids.get(name) not in known:
                trial.state = "pending"
                self.job_ids.pop(name, None)
                self.reported.pop(name, None)

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        state = {"run": self.run.state_dict(), "job_ids": self.job_ids, "reported": self.reported}
        temporary = self.folder / (STATE_FILE + ".tmp")
        temporary.write_text(json.dumps(state, indent=1))
        temporary.replace(self.folder / STATE_FILE)

    def poll(self) -> bool:
        """Start what may start, hand new objectives to the sweep, cancel what it stops, note what ended.
        True once every trial has ended."""
        for job in self.run.to_start():
            handle = self.client.submit(job, base_model=self.spec.base_model, seed=self.spec.seed,
                                        output_dir=str(Path(self.spec.output_dir) / job.name))
            self.job_ids[job.name] = handle.id
        for name, trial in self.run.trials.items():
            if trial.state != "running" or name not in self.job_ids:
                continue
            job_id = self.job_ids[name]
            record = self.client.status(job_id)   # before its losses: a job that ended has them all written
            live = record.state not in ENDS
            for step, objective in self._objectives(job_id):
                if step <= self.reported.get(name, 0):
                    continue
                self.reported[name] = step
                decision = self.run.report(name, step, objective, live=live)
                if trial.state == "stopped":
                    self._cancel(job_id)
                    print(f"{name}: stopped at step {step}: {decision.reason if decision else trial.stopped_because}")
                    break
            if trial.state == "running" and record.state in ENDS:
                self.run.ended(name, ENDS[record.state], record.step, record.reason)
                print(f"{name}: {trial.state} at step {record.step}"
                      + (f", objective {trial.objective:.4f}" if trial.objective is not None else ""))
        self._save()
        return self.run.done

    def _cancel(self, job_id: str) -> None:
        """Cancel a stopped trial's job; one that ended meanwhile (its last steps ran between two looks) has
        nothing left to stop."""
        if self.client.status(job_id).state not in ENDS:
            try:
                self.client.cancel(job_id)
            except ValueError as error:   # it ended between the look and the cancel
                if "already ended" not in str(error):
                    raise

    def _objectives(self, job_id: str) -> list[tuple[int, float]]:
        rows = self.client.losses(job_id)
        column = "eval_loss" if self.spec.objective == "eval_loss" else "loss"
        return sorted((int(row["step"]), float(row[column])) for row in rows if row.get(column) is not None)

    def follow(self, poll_s: float = 1.0) -> dict[str, Any]:
        while not self.poll():
            time.sleep(poll_s)
        board = self.run.leaderboard()
        (self.folder / LEADERBOARD_FILE).write_text(json.dumps(board, indent=1))
        return board


def leaderboard_table(board: dict[str, Any]) -> str:
    lines = [f"{'trial':<20}{'state':>11}{'steps':>7}{'objective':>11}  settings"]
    for trial in board["trials"]:
        objective = f"{trial['objective']:.4f}" if trial["objective"] is not None else "-"
        settings = ", ".join(f"{k}={_short(v)}" for k, v in trial["settings"].items())
        lines.append(f"{trial['name']:<20}{trial['state']:>11}{trial['steps']:>7}{objective:>11}  {settings}")
    lines.append(f"best: {board['best'] or 'none (no trial completed)'}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
