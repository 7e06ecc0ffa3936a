"""The generated docs, so that they cannot drift from the code: `docs/spec.md`, the jobs-file and
service-configuration reference from the pydantic models that validate them (every field with its type,
default, allowed range and description), and `docs/architecture.md`, the floor plan: every folder and
module with the first line of its docstring.

    python -m orchestrator.reference_docs      (writes both; tests/unit/test_reference_docs.py checks they are current)
"""

from __future__ import annotations

import ast
import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from actors.data import AlpacaFormat, ChatFormat, PreferenceFormat, PromptResponseFormat, TextFormat
from actors.service.scheduler.config import EventsConfig, MetricsConfig, ServiceConfig, StorageConfig, TrainerConfig
from actors.spec.evaluation_config import EarlyStopConfig
from actors.spec.field_types import AutoOr, Bounds
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from actors.spec.method_config import PreferenceConfig
from actors.spec.run_spec import RunSpec
from actors.spec.tracking_config import MlflowTracking, TrackingConfig
from actors.storage.storage_uri import StorageURI

SECTIONS: list[tuple[str, str, list[type[BaseModel]]]] = [
    ("Jobs file (`aspen run` / `aspen submit`)",
     "A YAML file: the run's settings at the top, its jobs under `jobs:`. Relative paths are relative to the "
     "file, but for `aspen submit` a relative `output_dir`: a shared service takes it under its output root (as "
     "its HTTP API does). An unknown field is an error that names the file, line, job and field.",
     [RunSpec, JobSpec, LoraConfig, EarlyStopConfig, PreferenceConfig, TrackingConfig, MlflowTracking]),
    ("Data formats (`format:` of a job)",
     "One of these, chosen by `type` (`format: {type: chat}`); one with no required field may be named by its "
     "type alone (`format: alpaca`).",
     [AlpacaFormat, PromptResponseFormat, ChatFormat, TextFormat, PreferenceFormat]),
    ("Service configuration (`aspen serve --config service.yaml`)",
     "The service's state, trainers and listeners; `aspen serve`'s flags set the common ones. Relative paths "
     "(`state_dir`, `output_root`, `data_roots`, a trainer's `step_log`, `staging_dir` and a `base_model` "
     "written as `./path`, `events.ca_file`) are relative to the file, for `aspen serve --config` and `aspen "
     "watch --events --config` alike; one that is not there but is in the current folder (where they were "
     "read from before) is taken from the current folder, with a warning.",
     [ServiceConfig, TrainerConfig, MetricsConfig, EventsConfig, StorageConfig]),
]


def type_name(annotation: typing.Any) -> str:
    """A field's type as a user reads it: `int`, `float or null`, `list of str or "all-linear"`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else str(a) for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, StorageURI):
        return "storage URI"
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(typing|pathlib|actors\.[\w.]+)\.", "", str(annotation))


def bounds(field: FieldInfo) -> str:
    found = [m.bounds if isinstance(m, AutoOr) else m for m in field.metadata if isinstance(m, Bounds | AutoOr)]
    for argument in typing.get_args(field.annotation):   # Optional[Annotated[..., Bounds]]
        found += [m for m in getattr(argument, "__metadata__", ()) if isinstance(m, Bounds)]
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    return found[0].describe() if found else (f"matches `{pattern}`" if pattern else "")


def default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(defaults below)"
    if value is None:
        return "null"
    if isinstance(value, Path):
        return f"`{value}`".replace(str(Path.home()), "~")
    if isinstance(value, list) and not value:
        return "[]"
    return f"`{value}`"


def model_table(model: type[BaseModel]) -> str:
    lines = [f"### {model.__name__}", ""]
    doc = (model.__doc__ or "").strip()
    if doc and not doc.startswith("Usage docs") and model.__doc__ is not BaseModel.__doc__:
        lines += [" ".join(doc.split()), ""]
    lines += ["| field | type | default | allowed | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        lines.append(f"| `{name}` | {type_name(field.annotation)} | {default(field)} | {bounds(field)} | "
                     f"{description} |")
    return "\n".join(lines) + "\n"


def render() -> str:
    """docs/spec.md."""
    parts = ["# aspen: jobs file and service configuration reference", "",
             "Generated from the models that validate them (`python -m orchestrator.reference_docs`;",
             "a test fails when this file is not current). Floats must be finite; integers that reach the job",
             "table stay within a signed 64-bit integer.", ""]
    listed = {model for _, _, models in SECTIONS for model in models}
    shown: set[type[BaseModel]] = set()
    for title, text, models in SECTIONS:
        parts += [f"## {title}", "", text, ""]
        for model in models:
            for each in [model, *linked_models(model, listed)]:
                if each not in shown:
                    shown.add(each)
                    parts.append(model_table(each))
    return "\n".join(parts).rstrip() + "\n"


def linked_models(model: type[BaseModel], listed: set[type[BaseModel]]) -> list[type[BaseModel]]:
    """The models `model`'s fields link to (`type_name`), and theirs, in field order, but those a section lists
    itself: each gets its table after the model that first links to it, so that no link of the page is dead."""
    found: list[type[BaseModel]] = []

    def visit(annotation: typing.Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in listed and annotation not in found:
                found.append(annotation)
                for field in annotation.model_fields.values():
                    visit(field.annotation)
            return
        for argument in typing.get_args(annotation):
            visit(argument)

    for field in model.model_fields.values():
        visit(field.annotation)
    return found


REPO = Path(__file__).resolve().parents[1]
# Folders in layer order, top (user-facing) first: imports point down this list only.
FOLDERS: list[tuple[str, str]] = [
    ("orchestrator", "user-facing: the client API, service start-up, Prometheus metrics, watching and reports"),
    ("orchestrator/cli", "the `aspen` command: its parser and each group of commands"),
    ("orchestrator/http", "the HTTP API (a router module per resource, built from the operations' catalogue), "
                          "its client, and the web console's routes"),
    ("orchestrator/mqtt", "MQTT job events: the embedded broker, topics, the listener that publishes"),
    ("orchestrator/tinker", "the Tinker API (the tinker SDK's REST protocol) over a trainer's interactive models"),
    ("orchestrator/simulator", "the scheduling simulator: a job trace replayed against policies, fast, no model"),
    ("actors", "the Ray actors, thin: the scheduler, a trainer per GPU (or CPU), a job actor per job"),
    ("actors/service", "the Ray-free halves of the actors, a room per concern (below)"),
    ("actors/service/scheduler", "the scheduler's side: decision rounds, submissions, the contained policy, which "
                                 "trainers run where, the job actor's data core"),
    ("actors/service/table", "the job table: jobs, transitions, progress, usage, over one SQLite connection"),
    ("actors/service/events", "what trainers report, taken in and booked into the job table; listeners"),
    ("actors/service/trainer", "the trainer's side: its loop over a step engine, the jobs it holds, their feeds, "
                               "memory admission, step log, how jobs end"),
    ("actors/service/outputs", "a job's outputs on its trainer: metrics files, uploads, experiment tracking"),
    ("actors/service/pipeline", "a pipeline trainer (stages over several devices) behind the step engine"),
    ("actors/service/sweeps", "sweeps over the service's jobs"),
    ("actors/service/accounts", "users, roles, tokens, the audit log"),
    ("actors/checkpoint", "a job's files: crash-safe checkpoints, PEFT adapters, exports and serving lines"),
    ("actors/engine", "the compute core, no Ray: base model, fused multi-LoRA layers, packing, per-job loss and "
                      "optimizer, generation, memory measurement, kernels"),
    ("actors/engine/pipeline", "the pipeline's compute: stages, their schedule, messages and transport"),
    ("actors/spec", "what a job is: the job spec and its settings, the sweep spec (pydantic, validated once)"),
    ("actors/data", "training data: formats, reading, tokenizing, splitting, the resumable cursor"),
    ("actors/storage", "where files live: durable local writes, storage URIs, base model sources and caches"),
    ("policies", "scheduling decisions over an immutable snapshot, no Ray: built-in policies, memory model, "
                 "loss-curve predictor"),
    ("policies/sweep", "a sweep's decisions: search spaces, searchers, early-stopping rules"),
]
# A newcomer's path through the code: one job from `aspen run` to a fused step and back to the job table.
# Every module named here must exist (render_floor_plan checks), so the path cannot point at a moved file.
NEWCOMERS_PATH: list[tuple[str, list[str]]] = [
    ("`aspen run jobs.yaml` reads and validates the jobs file, once",
     ["orchestrator/cli/run_commands.py", "orchestrator/jobs_file.py", "actors/spec/run_spec.py",
      "actors/spec/job_spec.py"]),
    ("decides what to do with jobs an earlier run left, and hands the rest, validated, to the client",
     ["orchestrator/run_plan.py", "orchestrator/client.py", "orchestrator/service_operations.py"]),
    ("the scheduler actor takes them as they were built and enters them in the job table, all or none",
     ["actors/scheduler_actor.py", "actors/spec/typed_args.py", "actors/service/scheduler/scheduler_core.py",
      "actors/service/scheduler/submissions.py", "actors/service/table/job_table.py",
      "actors/service/table/transition_log.py"]),
    ("each decision round asks the policy, contained, which queued jobs start where, under memory budgets",
     ["actors/service/scheduler/scheduler_core.py", "actors/service/scheduler/policy_guard.py", "policies/fifo.py",
      "actors/service/scheduler/job_fit.py"]),
    ("a started job gets a job actor (its data read and tokenized) and an Assignment on its trainer",
     ["actors/job_dispatch.py", "actors/job_actor.py", "actors/service/scheduler/job_data.py",
      "actors/data/tokenize.py", "actors/ray_links.py", "actors/service/trainer/job_link.py",
      "actors/service/scheduler/trainer_fleet.py", "actors/ray_trainers.py"]),
    ("the trainer's loop attaches the job's adapter, restores its newest checkpoint and starts its feed",
     ["actors/trainer_actor.py", "actors/service/trainer/trainer_loop.py", "actors/service/trainer/job_attach.py",
      "actors/engine/adapter_surgery.py", "actors/checkpoint/load.py", "actors/service/trainer/feed.py"]),
    ("each fused step is admitted under the memory budget, packed, and run: one forward/backward, each job's "
     "tokens through its own adapter, each job's loss and optimizer",
     ["actors/service/trainer/step_admission.py", "actors/service/trainer/step_engine.py", "actors/engine/trainer.py",
      "actors/engine/step_composition.py", "actors/engine/packing.py", "actors/engine/fused_linear.py",
      "actors/engine/lora_adapter.py", "actors/engine/loss.py", "actors/engine/optim.py",
      "actors/engine/joint_steps.py"]),
    ("the step's rows go to the step log and the job's metrics.jsonl, checkpoints are saved crash-safely",
     ["actors/service/trainer/step_booking.py", "actors/service/trainer/step_log.py",
      "actors/service/outputs/job_files.py", "actors/checkpoint/save.py", "actors/storage/durable.py"]),
    ("the scheduler polls the trainer's events and books them into the job table, in order",
     ["actors/service/trainer/trainer_reports.py", "actors/service/scheduler/trainer_fleet.py",
      "actors/service/events/event_intake.py", "actors/service/events/event_booking.py",
      "actors/service/table/progress_rows.py", "actors/service/table/usage_accounts.py"]),
    ("the job actor's loss history decides when training stops paying off; the job ends with its adapter saved "
     "in PEFT's format",
     ["actors/service/trainer/stop_verdicts.py", "policies/stopping.py", "actors/service/trainer/job_ends.py",
      "actors/checkpoint/peft_io.py"]),
]
TEST_FOLDERS = [
    ("tests/unit", "one module's behaviour against an independent reference (PEFT, TRL, a solo run), in the test's "
                   "process, no Ray, no server: `make test-unit` (`pytest -m unit`), the edit-test loop"),
    ("tests/slow", "like tests/unit, but minutes: the real smollm2-135m, torch.compile, memory measured in fresh "
                   "processes"),
    ("tests/service", "the service as users run it, on a real local Ray: actors, the CLI, the client, "
                      "`ray job submit`"),
    ("tests/servers", "against real servers: S3 (moto), prometheus, mosquitto, the HTTP API"),
    ("tests/faults", "failures caused on purpose: full disks, killed actors, damaged files, locked tables, bad input"),
    ("tests/gpu", "CUDA only, skipped without it (`bench/gpu_suite.py` runs them on a GPU)"),
    ("tests/helpers", "what tests share: tiny models, service runs, servers, fakes (no test module imports another)"),
]
OTHER_FOLDERS = [
    ("tests", "the test suite, a folder per kind, each a pytest marker (below); across them, the marker `long`: "
              "end-to-end scenarios of 20 s or more, run by `make test-long` (CI runs it after `make test`)"),
    ("bench", "benchmarks that print ratios measured side by side (results in docs/benchmarks.md)"),
    ("grafana", "the Grafana dashboard and provisioning"),
    ("examples", "a scheduling policy shipped as its own package (entry point group aspen.policies)"),
    ("docs", "this floor plan, the spec reference and the benchmark history"),
]


def first_line(path: Path) -> str:
    """The first sentence of a module's docstring (read without importing it)."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(docstring.split())
    match = re.match(r"(.+?\.)(\s|$)", text)
    sentence = (match.group(1) if match else text).rstrip(".")
    return sentence if len(sentence) <= 200 else sentence[:197].rsplit(" ", 1)[0] + " ..."


def _module_name(path: Path, repo: Path) -> str:
    return ".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__")


def import_arrows(repo: Path = REPO) -> dict[str, set[str]]:
    """Each product module and the product modules it imports (read from the source, not imported)."""
    files = {_module_name(path, repo): path for top in ("orchestrator", "actors", "policies")
             for path in sorted((repo / top).rglob("*.py"))}
    arrows: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            for module in imported:
                while module and module not in files:
                    module = module.rpartition(".")[0]
                if module and module != name:
                    targets.add(module)
        arrows[name] = targets
    return arrows


def room_of(module: str, rooms: list[str]) -> str | None:
    """The deepest room (a folder of FOLDERS, dotted) that holds `module`."""
    found = [room for room in rooms if module == room or module.startswith(room + ".")]
    return max(found, key=len) if found else None


def room_lines(repo: Path = REPO) -> list[str]:
    """The rooms' table: modules, lines, and the arrows (imports) inside each room and across to others."""
    rooms = [folder.replace("/", ".") for folder, _ in FOLDERS]
    arrows = import_arrows(repo)
    rows = ["| room | modules | lines | arrows inside | arrows out | arrows in |", "|---|---|---|---|---|---|"]
    for room in rooms:
        members = [m for m in arrows if room_of(m, rooms) == room]
        lines = sum(len((repo / (m.replace(".", "/"))).with_suffix(".py").read_text().splitlines())
                    if (repo / (m.replace(".", "/"))).with_suffix(".py").is_file()
                    else len((repo / m.replace(".", "/") / "__init__.py").read_text().splitlines()) for m in members)
        inside = sum(1 for m in members for t in arrows[m] if room_of(t, rooms) == room)
        out = sum(1 for m in members for t in arrows[m] if room_of(t, rooms) != room)
        into = sum(1 for m in arrows if room_of(m, rooms) != room for t in arrows[m] if room_of(t, rooms) == room)
        rows.append(f"| `{room.replace('.', '/')}/` | {len(members)} | {lines} | {inside} | {out} | {into} |")
    return rows


def render_floor_plan(repo: Path = REPO) -> str:
    parts = ["# aspen: floor plan", "",
             "Generated from the code (`python -m orchestrator.reference_docs`; a test fails when it is not "
             "current): every folder and the first line of each module's docstring.", "",
             "Rooms in layer order, top first; imports point down only (tests/unit/test_layers.py), and no two modules "
             "import each other round a circle:", ""]
    for folder, text in FOLDERS:
        parts.append(f"- `{folder}/`: {text}")
    parts.append("")
    for folder, text in FOLDERS:
        parts += [f"## `{folder}/`", "", text, "", "| module | what it holds |", "|---|---|"]
        others = [repo / f for f, _ in FOLDERS if f != folder and f.startswith(folder + "/")]
        for module in sorted((repo / folder).rglob("*.py")):
            if any(module.is_relative_to(other) for other in others):
                continue   # a folder of its own below
            if module.name == "__init__.py" and module.parent == repo / folder:
                continue
            name = module.relative_to(repo / folder).as_posix()
            if module.name == "__init__.py":
                name = module.parent.relative_to(repo / folder).as_posix() + "/"
            parts.append(f"| `{name}` | {first_line(module).replace('|', '/')} |")
        parts.append("")
    parts += ["## Rooms and their arrows", "",
              "An arrow is one module importing another; a room is a folder above (its sub-folders are rooms of "
              "their own).", ""]
    parts += room_lines(repo) + [""]
    parts += ["## A newcomer's path: one job, from `aspen run` to a fused step and back", ""]
    for number, (text, modules) in enumerate(NEWCOMERS_PATH, 1):
        missing = [m for m in modules if not (repo / m).exists()]
        if missing:
            raise FileNotFoundError(f"orchestrator/reference_docs.py NEWCOMERS_PATH names {missing}, which do not "
                                    "exist: point it at the modules that now hold that step")
        parts.append(f"{number}. {text}: " + ", ".join(f"`{m}`" for m in modules))
    parts.append("")
    parts += ["## Other folders", ""]
    parts += [f"- `{folder}/`: {text}" for folder, text in OTHER_FOLDERS]
    parts += ["", "## Tests", ""]
    for folder, text in TEST_FOLDERS:
        if not (repo / folder).is_dir():
            raise FileNotFoundError(f"orchestrator/reference_docs.py TEST_FOLDERS names {folder}, which does not exist")
        parts.append(f"- `{folder}/`: {text}")
    return "\n".join(parts).rstrip() + "\n"


GENERATED = {"docs/spec.md": render, "docs/architecture.md": render_floor_plan}


if __name__ == "__main__":
    for relative, make in GENERATED.items():
        (REPO / relative).write_text(make())
        print(f"wrote {relative}")
