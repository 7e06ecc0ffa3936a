"""`aspen sweep FILE`, `Client.sweep`, `POST /v1/sweeps`: a sweep's trials trained as ordinary jobs of a
service, weak ones stopped early, the leaderboard at the end.

The service's scheduler runs the sweep (actors/service/sweeps/sweep_book.py, sweep_driver.py): it starts each trial
when a slot opens (its settings from the sweep's searcher: random, grid, or a Ray Tune searcher such as
Optuna: policies/sweep/searchers.py), hands every objective to the stopping rules and cancels the trials they stop,
and keeps the sweep's state in its state folder, so a sweep goes on without whoever submitted it and
survives a restart. This module reads a sweep file (`load_sweep_spec`: paths relative to the file, errors
naming the file and field), follows a sweep to its end (`follow_sweep`), prints the leaderboard, and reads an
ended sweep's results from its folder (`read_results`). The Prometheus gauges of sweeps are
orchestrator/metrics.py's."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from actors.service.sweeps.sweep_book import LEADERBOARD_FILE
from actors.spec.run_spec import RunSpec
from actors.spec.sweep_spec import SweepSpec
from actors.spec.user_functions import functions_resolved, is_file_reference, split_reference
from orchestrator.jobs_file import FILE_LIMITS, SpecError, function_load_problems, read_spec_text, yaml_lines
from orchestrator.spec_text import TooComplex, load_yaml
from policies.sweep.searchers import BUILT_IN, build_searcher


def load_sweep_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep file; the job's data and the output folder are relative to the file's folder.
    Errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file")
    try:
        text = read_spec_text(path)
        data = load_yaml(text, FILE_LIMITS)
    except TooComplex as error:
        raise SpecError(f"{path}: {error}") from None
    return sweep_spec_from(data, source=str(path), base_dir=path.parent, text=text)


def service_run_spec(spec: SweepSpec) -> RunSpec:
    """The run a sweep's own service is configured from (`run_service_config`): its base model and step budget."""
    return RunSpec(base_model=spec.base_model, output_dir=spec.output_dir, step_tokens=spec.step_tokens,
                   seed=spec.seed, jobs=[spec.job])


def _resolve_function_files(data: dict, source: str, base_dir: Path | None) -> None:
    """A function of the user's named by its file (`file.py:function`: the job's reward or generation metric, the
    objective's metric), as the job's data: relative to the sweep file."""
    job = data.get("job")
    places = [(job, "grpo", "reward"), (job, "eval_generate", "metric"), (data, "objective", "metric")]
    for parent, section, key in places:
        inner = parent.get(section) if isinstance(parent, dict) else None
        value = inner.get(key) if isinstance(inner, dict) else None
        named = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        files = [item for item in named if isinstance(item, str) and is_file_reference(item)]
        if not files:
            continue
        if base_dir is not None:
            parent[section] = {**inner, key: functions_resolved(value, base_dir)}
            continue
        for item in files:
            if not Path(split_reference(item)[0]).expanduser().is_absolute():
                raise SpecError(f"{source}: {section}.{key}: {item} names a relative file; give an absolute path on "
                                "the service's machine")


def _check_functions(spec: SweepSpec, source: str, lines: dict) -> None:
    """Each function of the user's that the sweep names loads here (not first in a trial, on a trainer). A metric
    objective is the job's eval_generate (SweepSpec): named as the objective."""
    objective = not isinstance(spec.objective, str)
    problems = []
    named = [("objective.metric" if objective and field == "eval_generate.metric" else f"job.{field}", reference)
             for field, reference in spec.job.user_functions()]
    for (name, _), error in zip(named, function_load_problems(named), strict=True):
        if error is not None:
            line = _line_of(name, lines)
            problems.append(f"{source}:{line}: {error}" if line else f"{source}: {error}")
    if problems:
        raise SpecError("\n".join(problems))


def sweep_spec_from(data: Any, *, source: str, base_dir: Path | None, text: str | None = None) -> SweepSpec:
    """A sweep from its parsed YAML / JSON: relative paths (the job's data, the output folder) against
    `base_dir` (None: they must be absolute: the service's machine cannot know what they are relative to).
    With the file's `text`, each refusal names the line of the field it is about."""
    lines = yaml_lines(text) if text else {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping with name, job, space, ... at the top level")
    data = dict(data)
    if isinstance(data.get("job"), dict):
        data["job"] = dict(data["job"])
    job = data.get("job")
    for holder, key, name in ((job, "data", "job.data"), (job, "init_adapter", "job.init_adapter"),
                              (data, "output_dir", "output_dir")):
        value = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(value, str) or "://" in value:
            continue
        if base_dir is not None:
            holder[key] = str((base_dir / Path(value).expanduser()).resolve())
        elif not Path(value).expanduser().is_absolute():
            raise SpecError(f"{source}: {name}: {value} is a relative path; give an absolute path on the service's "
                            "machine (or a storage URI)")
    _resolve_function_files(data, source, base_dir)
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as error:
        problems = []
        for problem in error.errors():
            where = ".".join(str(part) for part in problem["loc"])
            message = problem["msg"].removeprefix("Value error, ")
            # a check of the whole sweep names its field at the start of its message (`space.lora.rank: ...`)
            named = where or message.split(": ", 1)[0]
            line = _line_of(named, lines)
            problems.append(f"{source}:{line}: " if line else f"{source}: ")
            problems[-1] += f"{where + ': ' if where else ''}{message}"
        raise SpecError("\n".join(problems)) from None
    if spec.search not in BUILT_IN:   # a searcher that cannot be built (not installed, bad options): now
        try:
            build_searcher(spec.search, spec.parsed_space(), trials=spec.trials, seed=spec.seed,
                           options=spec.search_options)
        except ValueError as error:
            line = _line_of(str(error).split(": ", 1)[0], lines)
            raise SpecError(f"{source}:{line}: {error}" if line else f"{source}: {error}") from None
    _check_functions(spec, source, lines)
    return spec


def _line_of(dotted: str, lines: dict[tuple, int]) -> int | None:
    """The line of the longest YAML path that `dotted` (e.g. space.lora.r.choice, whose space key has a dot)
    starts with."""
    best, length = None, -1
    for path, line in lines.items():
        text = ".".join(str(part) for part in path)
        if path and (dotted == text or dotted.startswith(text + ".")) and len(text) > length:
            best, length = line, len(text)
    return best


def follow_sweep(client: Any, name: str, *, poll_s: float = 1.0, say=print, progress_every_s: float = 10.0,
                 clock=time.monotonic) -> dict[str, Any]:
    """Wait for a sweep to end, saying each trial's state as it changes (with its settings when it starts, and
    why it stopped), and a running trial's step at most every `progress_every_s` seconds while it advances;
    its last status. A trial its user's quota holds back is said once each time the reason changes (`waiting`)."""
    seen: dict[str, tuple[str, int]] = {}
    said_at: dict[str, float] = {}
    waiting = None
    while True:
        status = client.sweep_status(name)
        if status.get("waiting") and status["waiting"] != waiting:
            say(f"waits to be submitted: {status['waiting']} (submitted once the quota lets it in)")
        waiting = status.get("waiting")
        for trial in sorted(status["trials"], key=lambda t: _trial_number(t["name"])):
            key, state, steps = trial["name"], trial["state"], trial["steps"]
            before = seen.get(key)
            if before is not None and before[0] == state and (
                    before[1] == steps or clock() - said_at.get(key, 0.0) < progress_every_s):
                continue
            if before is None and state == "pending":
                seen[key] = (state, steps)
                continue
            seen[key], said_at[key] = (state, steps), clock()
            say(trial_line(trial, started=before is None or before[0] == "pending"))
        if status["state"] != "running":
            return status
        time.sleep(poll_s)


def trial_line(trial: dict[str, Any], *, started: bool = False) -> str:
    """One trial in a line: its state and step, its objective (and the step it is from), its settings when
    it has just started, why it stopped."""
    line = f"{trial['name']}: {trial['state']} at step {trial['steps']}"
    if trial["objective"] is not None:
        line += f", objective {trial['objective']:.4f}"
    if started:
        line += f" ({settings_text(trial['settings'])})"
    if trial["state"] != "completed" and trial.get("stopped_because"):
        line += f": {trial['stopped_because']}"
    return line + continued_note(trial)


def continued_note(trial: dict[str, Any]) -> str:
    """What a trial's row says of a job continued after the trial ended (`aspen extend`, `aspen resume`): the step
    it was continued from; its objective and steps are the continued job's."""
    if trial.get("continued_from") is None:
        return ""
    return f" (continued from step {trial['continued_from']}" + (": training on)" if trial["state"] == "continued"
                                                                 else ")")


def settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_short(v)}" for k, v in settings.items())


def read_results(folder: Path) -> dict[str, Any]:
    """An ended sweep's leaderboard from its output folder (no service needed)."""
    path = Path(folder) / LEADERBOARD_FILE
    if not path.is_file():
        raise SpecError(f"{folder}: no {LEADERBOARD_FILE} (not a sweep's folder, or no trial of it has ended yet)")
    return json.loads(path.read_text())


def _trial_number(name: str) -> int:
    tail = name.rsplit("-t", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def leaderboard_table(board: dict[str, Any]) -> str:
    lines = [f"{'trial':<20}{'state':>11}{'steps':>7}{'objective':>11}  settings"]
    for trial in board["trials"]:
        objective = f"{trial['objective']:.4f}" if trial["objective"] is not None else "-"
        settings = settings_text(trial["settings"])
        lines.append(f"{trial['name']:<20}{trial['state']:>11}{trial['steps']:>7}{objective:>11}  {settings}"
                     + continued_note(trial))
    lines.append(f"best: {board['best'] or 'none (no trial completed)'}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
