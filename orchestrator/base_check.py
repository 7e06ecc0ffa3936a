"""A jobs file's base model checked before `aspen run` starts anything, each problem naming the file, line and field:
that the base exists (before an earlier run's jobs are compared with the file's: a typo'd base path is that, not a
changed spec), and that every job's `lora.target_modules` names linear layers the base has (read from its config,
the model built on `meta` in a process of its own: actors/engine/base_layers.py), rather than each job failing once
its trainer has loaded the base."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from actors.spec.run_spec import RunSpec
from orchestrator.jobs_file import SpecError, read_spec_text, yaml_lines

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 600   # a GGUF base is converted first, as its trainer would (minutes for a large one)


def _where(file: str | Path, lines: dict[tuple, int], path: tuple) -> str:
    """`file:line` of the nearest part of `path` the file names (a job's line where its lora is the default)."""
    line = next((lines[path[:end]] for end in range(len(path), -1, -1) if path[:end] in lines), None)
    return f"{file}:{line}" if line else str(file)


def check_base_exists(spec: RunSpec, file: str | Path) -> None:
    """A `SpecError` naming the file's line and field base_model where the base does not exist (a path that is not
    there, a hub id not in the local Hugging Face cache), with what to give instead."""
    from actors.storage.sources import resolve_source

    try:
        resolve_source(spec.base_model)
    except FileNotFoundError as error:
        lines = yaml_lines(read_spec_text(Path(file)))
        message = str(error).removeprefix("base_model: ")
        raise SpecError(f"{_where(file, lines, ('base_model',))}: base_model: {message}\n(nothing was started: fix "
                        "base_model, then run again)") from None


def check_target_modules(spec: RunSpec, file: str | Path) -> None:
    """A `SpecError` naming, for each job's `lora.target_modules` entry that matches no linear layer of the base (or
    names one its model type leaves alone), the file's line, the job, the name and the base's layer names (the
    nearest one first). A base whose config cannot be read or built is left to its trainer, which says why."""
    named = [(index, job) for index, job in enumerate(spec.jobs) if isinstance(job.lora.target_modules, list)
             and job.lora.target_modules]
    if not named:
        return
    targets = [t for _, job in named for t in job.lora.target_modules]
    if _all_in_checkpoint(spec.base_model, targets):   # the common case, answered without a process of its own
        return
    if _unconverted_gguf(spec.base_model):   # its conversion (10-30 s, said by its trainer as it loads) comes first
        log.info("lora.target_modules checked by the trainer: %s's GGUF file is converted as it loads", spec.base_model)
        return
    found = _target_problems(spec.base_model, targets)
    if found is None:
        return
    lines = yaml_lines(read_spec_text(Path(file)))
    problems: list[str] = []
    for index, job in named:
        for position, target in enumerate(job.lora.target_modules):
            if found.get(target) is not None:
                where = _where(file, lines, ("jobs", index, "lora", "target_modules", position))
                problems.append(f"{where}: job '{job.name}' (jobs[{index}]), field lora.target_modules: "
                                f"{str(found[target]).removeprefix('lora.target_modules: ')}")
    if problems:
        raise SpecError("\n".join(problems) + f"\n(nothing was started: fix the names for base {spec.base_model}, "
                        "then run again)")


EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")   # a MoE config: mlp names may be left alone
EMBEDDINGS = ("embed", "wte", "wpe", "lm_head")   # 2-D weights of modules that are not adapted linear layers


def checkpoint_layers(base_model: str) -> set[str] | None:
    """The names of the 2-D weights' modules in the base's safetensors files (their headers only, no torch): a
    folder's, or a GGUF file's converted folder where its trainer has built it. None where there are none to read,
    or the base's config names experts (their layers may be ones aspen leaves alone: the full check says)."""
    from actors.storage.sources import cache_root, converted_folder_path, resolve_source

    try:
        source = resolve_source(base_model)
        root = cache_root()
        folder = (Path(source.path) if source.gguf_file is None
                  else converted_folder_path(source, root) if root is not None else None)
        if folder is None or not folder.is_dir():
            return None
        config = json.loads((folder / "config.json").read_text())
        files = sorted(folder.glob("*.safetensors"))
        if not files or any(key in config for key in EXPERTS_KEYS) or any(
                isinstance(v, dict) and any(key in v for key in EXPERTS_KEYS) for v in config.values()):
            return None
        names = {name.removesuffix(".weight") for file in files for name, entry in _header(file).items()
                 if name.endswith(".weight") and isinstance(entry, dict) and len(entry.get("shape", ())) == 2}
        return {name for name in names if not any(word in name.rsplit(".", 1)[-1] for word in EMBEDDINGS)}
    except (OSError, ValueError) as error:   # unreadable here: the full check (or the trainer) says what is wrong
        log.debug("the base's safetensors headers were not read (%s); its config is built instead", error)
        return None


def _header(file: Path) -> dict:
    """A safetensors file's header: 8 bytes of its length (little-endian), then that much JSON."""
    with file.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size < 100_000_000:
            raise ValueError(f"{file}: not a safetensors header")
        return json.loads(handle.read(size))


def _unconverted_gguf(base_model: str) -> bool:
    """Whether `base_model` is a GGUF file whose converted folder its first trainer has yet to build: the check would
    build it before the run says anything (a silent wait), where the trainer's load says it as it happens."""
    from actors.storage.sources import cache_root, converted_folder_path, resolve_source

    try:
        source = resolve_source(base_model)
    except FileNotFoundError:
        return False
    root = cache_root()
    return source.gguf_file is not None and (root is None or not (converted_folder_path(source, root)
                                                                  / "config.json").is_file())


def _all_in_checkpoint(base_model: str, targets: list[str]) -> bool:
    """Whether every target names a 2-D weight's module of the base's checkpoint, by PEFT's rule (the name, or its
    last components): then there is nothing to refuse (a target it lacks, or any doubt, goes to the full check)."""
    layers = checkpoint_layers(base_model)
    return layers is not None and all(
        any(name == target or name.endswith("." + target) for name in layers) for target in targets)


def _target_problems(base_model: str, targets: list[str]) -> dict[str, str | None] | None:
    """Each target's problem on the base (actors/engine/base_layers.py), found in a process of its own: this one (the
    run's driver) imports no torch and keeps no model. None where the base's config cannot be read or built there
    (logged): its trainer's load then says what is wrong with the base."""
    try:
        done = subprocess.run([sys.executable, "-m", "actors.engine.base_layers", base_model, json.dumps(targets)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.info("lora.target_modules not checked before the run starts: reading %s's config took over %d s",
                 base_model, CHECK_TIMEOUT_S)
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        log.info("lora.target_modules not checked before the run starts (the base's config: %s)", why)
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:   # something else printed last: the trainer checks the names as it starts
        log.info("lora.target_modules not checked before the run starts (its check printed %r)", lines[-1][:200])
        return None
