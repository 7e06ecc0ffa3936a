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
     "file. An unknown field is an error that names the file, line, job and field.",
     [RunSpec, JobSpec, LoraConfig, EarlyStopConfig, PreferenceConfig, TrackingConfig, MlflowTracking]),
    ("Data formats (`format:` of a job)", "One of these, chosen by `type`.",
     [AlpacaFormat, PromptResponseFormat, ChatFormat, TextFormat, PreferenceFormat]),
    ("Service configuration (`aspen serve --config service.yaml`)",
     "The service's state, trainers and listeners; `aspen serve`'s flags set the common ones.",
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
    for title, text, models in SECTIONS:
        parts += [f"## {title}", "", text, ""]
        parts += [model_table(model) for model in models]
    return "\n".join(parts).rstrip() + "\n"


REPO = Path(__file__).resolve().parents[1]
# Folders in layer order, top (user-facing) first: imports point down this list only.
FOLDERS: list[tuple[str, str]] = [
    ("orchestrator", "user-facing: the client API, the `aspen` CLI, service start-up, Prometheus metrics, MQTT "
                     "job events, watching and reports"),
    ("actors", "the Ray actors, thin: the scheduler, a trainer per GPU (or CPU), a job actor per job"),
    ("actors/service", "the Ray-free halves of the actors: the scheduler's decisions and job table, the "
                    "trainer's loop, a job's data feed and files"),
    ("actors/engine", "the compute core, no Ray: base model, fused multi-LoRA layer, packing, per-job loss "
                      "and optimizer, checkpoints, PEFT export, memory measurement, data formats"),
    ("policies", "scheduling decisions over an immutable snapshot, no Ray: built-in policies, memory model, "
                 "loss-curve predictor, simulator"),
]
# A newcomer's path through the code: one job from `aspen run` to a fused step and back to the job table.
# Every module named here must exist (render_floor_plan checks), so the path cannot point at a moved file.
NEWCOMERS_PATH: list[tuple[str, list[str]]] = [
    ("`aspen run jobs.yaml` reads and validates the jobs file",
     ["orchestrator/cli/run_commands.py", "orchestrator/jobs_file.py", "actors/spec/run_spec.py",
      "actors/spec/job_spec.py"]),
    ("decides what to do with jobs an earlier run left, and submits the rest through the client",
     ["orchestrator/run_plan.py", "orchestrator/client.py"]),
    ("the scheduler actor enters them in the job table, all or none", ["actors/scheduler_actor.py",
                                                                       "actors/service/scheduler/submissions.py",
                                                                       "actors/service/table/job_table.py"]),
    ("each decision round asks the policy, contained, which queued jobs start where, under memory budgets",
     ["actors/service/scheduler/scheduler_core.py", "actors/service/scheduler/policy_guard.py", "policies/fifo.py",
      "actors/service/scheduler/job_fit.py"]),
    ("a started job gets a job actor (its data, tokenized) and an assignment on its trainer",
     ["actors/job_dispatch.py", "actors/job_actor.py", "actors/service/scheduler/job_data.py",
      "actors/service/trainer/job_link.py"]),
    ("the trainer's loop attaches the job's adapter and restores its newest checkpoint",
     ["actors/trainer_actor.py", "actors/service/trainer/trainer_loop.py", "actors/service/trainer/job_attach.py"]),
    ("each fused step is admitted under the memory budget, packed, and run: one forward/backward, each job's "
     "tokens through its own adapter, each job's loss and optimizer",
     ["actors/service/trainer/step_admission.py", "actors/engine/trainer.py", "actors/engine/packing.py",
      "actors/engine/lora.py", "actors/engine/loss.py", "actors/engine/optim.py"]),
    ("the step's rows go to the step log and the job's metrics.jsonl, checkpoints are saved crash-safely",
     ["actors/service/trainer/step_log.py", "actors/service/outputs/job_files.py", "actors/checkpoint/save.py"]),
    ("the scheduler polls the trainer's events and books them into the job table, in order",
     ["actors/service/scheduler/trainer_fleet.py", "actors/service/events/event_intake.py",
      "actors/service/events/event_booking.py"]),
    ("the job actor's loss history decides when training stops paying off; the adapter is saved in PEFT's format",
     ["actors/service/trainer/stop_verdicts.py", "policies/stopping.py", "actors/checkpoint/peft_io.py"]),
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
    ("tests", "the test suite, a folder per kind, each a pytest marker (below)"),
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


def render_floor_plan(repo: Path = REPO) -> str:
    parts = ["# aspen: floor plan", "",
             "Generated from the code (`python -m orchestrator.reference_docs`; a test fails when it is not "
             "current): every folder and the first line of each module's docstring.", "",
             "Layers, top first; imports point down only:", ""]
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
