"""What each `lora.target_modules` name does on a base model, found before a job is entered: by `aspen run`, `aspen
submit`, `aspen sweep` (orchestrator/base_check.py) and the HTTP API (orchestrator/http/target_checks.py), rather than
by the job's trainer once it was queued, placed and had loaded the base (the job failed then).

The base's linear layers are read, quickest first:
- every name a 2-D weight of its safetensors files (their headers: a folder's, or a GGUF file's converted folder):
  then nothing is refused, and nothing more is read (`checkpoint_layers`);
- a GGUF file's header, named as transformers names its tensors once converted (actors/storage/gguf_header.py): a
  GGUF base's first run has no converted folder yet (converting takes 10-30 s, its trainer's first load);
- else the model built on `meta` from its config in a process of its own (actors/engine/base_layers.py: seconds of
  CPU; the checking process imports no torch), whose answer is kept per base, its path and its modification time
  (the HTTP server checks every submission). A GGUF file with neither is left to its trainer (it would be converted
  first).
A base that does not exist here, or whose config cannot be read or built, is left to its trainer, which says why."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from actors.engine.lora_targets import target_problem

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 600   # the model built on meta from its config (a converted GGUF file's: minutes for a large one)
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")   # a MoE config: mlp names may be left alone
EMBEDDINGS = ("embed", "wte", "wpe", "lm_head")   # 2-D weights of modules that are not adapted linear layers


@dataclass(frozen=True)
class BaseLayers:
    """A base's linear layers LoRA may adapt, its model type, and the short names of those it leaves alone."""

    linear: tuple[str, ...]
    model_type: str | None
    unadapted: tuple[str, ...] = ()

    def problems(self, targets: list[str]) -> dict[str, str | None]:
        """Each target with why it cannot adapt the base (None: it can)."""
        return {target: target_problem(list(self.linear), self.unadapted, self.model_type, [target])
                for target in dict.fromkeys(targets)}


_KEPT: dict[tuple, BaseLayers | None] = {}   # by base, its path and its modification time
_LOCKS: dict[tuple, threading.Lock] = {}     # one per key: submissions arriving together on a new base read it once
_TABLE = threading.Lock()


def target_problems(base_model: str, targets: list[str]) -> dict[str, str | None] | None:
    """Each of `targets` with why it cannot adapt `base_model` (None: it can), or None where the base's layers cannot
    be read here (its trainer then says what is wrong)."""
    if not targets:
        return {}
    if _all_in_checkpoint(base_model, targets):   # the common case, answered from the headers alone
        return dict.fromkeys(targets)
    layers = base_layers(base_model)
    return None if layers is None else layers.problems(targets)


def base_layers(base_model: str) -> BaseLayers | None:
    """`base_model`'s layers (kept per base, path and modification time), or None where they cannot be read here."""
    from actors.storage.sources import resolve_source

    try:
        source = resolve_source(base_model)
        path = Path(source.description) if source.gguf_file else Path(source.path) / "config.json"
        key = (base_model, str(path.resolve()), path.stat().st_mtime_ns)
    except (OSError, ValueError) as error:   # not here (FileNotFoundError): left to its trainer
        log.info("lora.target_modules not checked before the job starts: %s", error)
        return None
    with _TABLE:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if _KEPT.get(key) is None:   # what could not be read is read again (a GGUF file converted since, say)
            _KEPT[key] = _read_layers(base_model, source.gguf_file is not None)
        return _KEPT[key]


def _read_layers(base_model: str, gguf: bool) -> BaseLayers | None:
    if gguf:
        from actors.storage.gguf_header import hf_linear_names
        from actors.storage.sources import cache_root, converted_folder_path, resolve_source

        try:
            found = hf_linear_names(resolve_source(base_model).description)
        except (OSError, ValueError) as error:
            log.info("the GGUF header of %s was not read (%s)", base_model, error)
            found = None
        if found is not None:
            return BaseLayers(tuple(found[1]), found[0])
        root = cache_root()
        if root is None or not (converted_folder_path(resolve_source(base_model), root) / "config.json").is_file():
            log.info("lora.target_modules checked by the trainer: %s's GGUF file is converted as it loads", base_model)
            return None
    return _meta_layers(base_model)


def _meta_layers(base_model: str) -> BaseLayers | None:
    """The base's layers from its model built on `meta` in a process of its own (actors/engine/base_layers.py): this
    one imports no torch and keeps no model. None where its config cannot be read or built there (logged)."""
    try:
        done = subprocess.run([sys.executable, "-m", "actors.engine.base_layers", base_model],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.info("lora.target_modules not checked before the job starts: reading %s's config took over %d s",
                 base_model, CHECK_TIMEOUT_S)
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        log.info("lora.target_modules not checked before the job starts (the base's config: %s)", why)
        return None
    try:
        found = json.loads(lines[-1])
        return BaseLayers(tuple(found["linear"]), found["model_type"], tuple(found["unadapted"]))
    except (ValueError, KeyError, TypeError):   # something else printed last: the trainer checks the names
        log.info("lora.target_modules not checked before the job starts (its check printed %r)", lines[-1][:200])
        return None


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


def _all_in_checkpoint(base_model: str, targets: list[str]) -> bool:
    """Whether every target names a 2-D weight's module of the base's checkpoint, by PEFT's rule (the name, or its
    last components): then there is nothing to refuse (a target it lacks, or any doubt, goes to the full check)."""
    layers = checkpoint_layers(base_model)
    return layers is not None and all(
        any(name == target or name.endswith("." + target) for name in layers) for target in targets)
