"""What each `lora.target_modules` name does on a base model, found before a job is entered: by `aspen run`, `aspen
submit`, `aspen sweep` (orchestrator/base_check.py) and the HTTP API (orchestrator/http/target_checks.py), rather than
by the job's trainer once it was queued, placed and had loaded the base (the job failed then).

The base's linear layers are read, quickest first:
- every name a 2-D weight of its safetensors files (their headers: a folder's, or a GGUF file's converted folder
  where its header names an architecture aspen trains from GGUF): then nothing is refused, and nothing more is read
  (`checkpoint_layers`);
- a GGUF file's header, named as transformers names its tensors once converted (actors/storage/gguf_header.py): a
  GGUF base's first run has no converted folder yet (converting takes 10-30 s, its trainer's first load);
- else the model built on `meta` from its config in a process of its own (actors/engine/base_layers.py: seconds of
  CPU; the checking process imports no torch). A GGUF file with neither is left to its trainer (it would be
  converted first).
The answer, or why there is none, is kept per base and its files' identity (path, modification time, size: a base
replaced on disk is read again), for the `KEPT_MAX` bases last asked (the HTTP server checks every submission); a
failure that may pass without the file changing (the model built past `CHECK_TIMEOUT_S`, or killed; an I/O error) is
not kept, but tried again at the next submission.
A GGUF file of an architecture aspen cannot train from GGUF is refused, naming it and those it can. A base that does
not exist here, or whose config cannot be read or built, is left to its trainer, which says why (logged once per
identity of its files, naming the file, what is wrong and what to do)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections import OrderedDict
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
    refused: str | None = None   # why no job trains on this base (a GGUF architecture aspen cannot train)

    def problems(self, targets: list[str]) -> dict[str, str | None]:
        """Each target with why it cannot adapt the base (None: it can)."""
        if self.refused is not None:
            return dict.fromkeys(targets, self.refused)
        return {target: target_problem(list(self.linear), self.unadapted, self.model_type, [target])
                for target in dict.fromkeys(targets)}


KEPT_MAX = 64   # bases whose layers (or why they cannot be read) are kept, the least recently asked dropped first
_KEPT: OrderedDict[tuple, BaseLayers | Unreadable] = OrderedDict()   # by base and its files' identity
_LOCKS: OrderedDict[tuple, threading.Lock] = OrderedDict()   # one per key: submissions together on a base read it once
_TABLE = threading.Lock()


@dataclass(frozen=True)
class Unreadable:
    """Why a base's layers could not be read here (said once, kept until its files change)."""

    why: str
    warn: bool = True   # False: nothing is wrong (a GGUF file not converted yet)
    kept: bool = True   # False: a failure that may pass without the file changing (a timeout, an I/O error): read again


def target_problems(base_model: str, targets: list[str]) -> dict[str, str | None] | None:
    """Each of `targets` with why it cannot adapt `base_model` (None: it can), or None where the base's layers cannot
    be read here (its trainer then says what is wrong)."""
    if not targets:
        return {}
    if _all_in_checkpoint(base_model, targets):   # the common case, answered from the headers alone
        return dict.fromkeys(targets)
    layers = base_layers(base_model)
    return None if layers is None else layers.problems(targets)


def files_identity(*paths: Path) -> tuple:
    """Each file's resolved path, modification time (ns), size and status change time (ns: a permission fixed),
    or the path alone where it is not there: a file replaced in place (a new config.json or GGUF file, a checkpoint
    downloaded again, one copied keeping its modification time) has another identity."""
    found = []
    for path in paths:
        try:
            stat = path.stat()
            found.append((str(path.resolve()), stat.st_mtime_ns, stat.st_size, stat.st_ctime_ns))
        except OSError:
            found.append((str(path.absolute()), None))
    return tuple(found)


def base_layers(base_model: str) -> BaseLayers | None:
    """`base_model`'s layers, or None where they cannot be read here (why: logged once per identity of its files).
    Both are kept per base and its files' identity (`files_identity`: its config.json, or its GGUF file and its
    converted folder's config.json), the `KEPT_MAX` last asked: a base replaced on disk is read again, and so is
    a file fixed since; an unreadable one is not read again on each submission."""
    from actors.storage.sources import resolve_source

    try:
        source = resolve_source(base_model)
        key = (base_model, *_identity(source))
    except (OSError, ValueError) as error:   # not here (FileNotFoundError): left to its trainer
        _say_once((base_model, str(error)), f"lora.target_modules not checked before the job starts: {error}")
        return None
    with _TABLE:
        lock = _LOCKS.setdefault(key, threading.Lock())
        _LOCKS.move_to_end(key)
        while len(_LOCKS) > KEPT_MAX:
            _LOCKS.popitem(last=False)
    with lock:
        with _TABLE:
            found = _KEPT.get(key)
        if found is None:
            found = _read_layers(base_model, source)
            if isinstance(found, Unreadable):
                (log.warning if found.warn else log.info)(
                    "lora.target_modules of jobs on base_model %s are not checked before they start: %s",
                    base_model, found.why)
        if not isinstance(found, Unreadable) or found.kept:
            with _TABLE:
                _KEPT[key] = found
                _KEPT.move_to_end(key)
                while len(_KEPT) > KEPT_MAX:
                    _KEPT.popitem(last=False)
    return None if isinstance(found, Unreadable) else found


def base_refusal(base_model: str) -> str | None:
    """Why no job trains on `base_model` whatever its `lora.target_modules` (`all-linear` too): a GGUF file of an
    architecture aspen cannot train, read from its header (kept as `base_layers` keeps it). None where nothing
    refuses it, or it cannot be read here; a base that is not a GGUF file is not read at all."""
    from actors.storage.sources import resolve_source

    try:
        if resolve_source(base_model).gguf_file is None:
            return None
    except (OSError, ValueError):   # not here: `base_layers` says so where names are checked
        return None
    layers = base_layers(base_model)
    return None if layers is None else layers.refused


def _identity(source) -> tuple:
    """What a base's layers are read from, identified (`files_identity`)."""
    from actors.storage.sources import cache_root, converted_folder_path

    if source.gguf_file is None:
        return files_identity(config_file(source))
    gguf = Path(source.path) / source.gguf_file
    root = cache_root()
    converted = [converted_folder_path(source, root) / "config.json"] if root is not None else []
    return files_identity(gguf, *converted)


def config_file(source) -> Path:
    """A folder base's config.json, or a hub id's in the local Hugging Face cache (its snapshot's: a checkpoint
    downloaded again is another revision's file). FileNotFoundError where the cache has none."""
    folder = Path(source.path)
    if folder.is_dir():
        return folder / "config.json"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source.path, "config.json")
    if not isinstance(cached, str):
        raise FileNotFoundError(f"base_model '{source.path}': no config.json in the local Hugging Face cache")
    return Path(cached)


_SAID: OrderedDict[tuple, None] = OrderedDict()


def _say_once(key: tuple, message: str) -> None:
    with _TABLE:
        if key in _SAID:
            return
        _SAID[key] = None
        while len(_SAID) > KEPT_MAX:
            _SAID.popitem(last=False)
    log.info(message)


def _read_layers(base_model: str, source) -> BaseLayers | Unreadable:
    if source.gguf_file is not None:
        from actors.storage.gguf_header import UnsupportedArchitecture, hf_linear_names
        from actors.storage.sources import cache_root, converted_folder_path

        gguf = Path(source.path) / source.gguf_file
        try:
            found = hf_linear_names(gguf)
        except UnsupportedArchitecture as error:   # its trainer could not train it either: refused at submit
            return BaseLayers((), error.architecture, refused=str(error))
        except ValueError as error:   # a damaged header: the same until the file changes
            return Unreadable(f"{_reason(error, gguf)}; {FIX_GGUF}")
        except OSError as error:   # an I/O error (a permission fixed changes the file's identity too): read again
            return Unreadable(f"{_reason(error, gguf)}; {FIX_GGUF}", kept=False)
        if found is not None:
            model_type, linear = found
            return BaseLayers(tuple(linear), model_type, _unadapted(model_type))
        root = cache_root()
        if root is None or not (converted_folder_path(source, root) / "config.json").is_file():
            return Unreadable(f"{gguf}: its GGUF file is converted as its trainer loads it, which checks them then "
                              "(the check here reads the converted folder once it is there)", warn=False)
    return _meta_layers(base_model, source)


FIX_GGUF = ("replace the file (download it again: a copy cut short or not a GGUF file) or make it readable to this "
            "process; it is read again once it changes, until then its trainer checks the names as it loads it")
FIX_CONFIG = ("fix or replace the base's config.json (or make it readable to this process); it is read again once "
              "it changes, until then its trainer checks the names as it loads the base")


def _reason(error: BaseException, file: Path) -> str:
    """What is wrong, naming the file (an OSError's own words name it; a header's ValueError too)."""
    said = str(error)
    if isinstance(error, PermissionError):
        return f"{file}: this process may not read it (permission denied)"
    if isinstance(error, FileNotFoundError):
        return f"{file}: not there"
    return said if str(file) in said else f"{file}: {said}"


def _unadapted(model_type: str) -> tuple[str, ...]:
    from actors.engine.model_support import SUPPORTED

    row = SUPPORTED.get(model_type)
    return tuple(row.unadapted) if row is not None else ()


def _meta_layers(base_model: str, source) -> BaseLayers | Unreadable:
    """The base's layers from its model built on `meta` in a process of its own (actors/engine/base_layers.py): this
    one imports no torch and keeps no model. Unreadable where its config cannot be read or built there."""
    try:
        config = config_file(source) if source.gguf_file is None else f"{base_model}'s converted config.json"
    except FileNotFoundError:   # gone since its identity was read
        config = f"{base_model}'s config.json"
    try:
        done = subprocess.run([sys.executable, "-m", "actors.engine.base_layers", base_model],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Unreadable(f"{config}: building its model on meta took over {CHECK_TIMEOUT_S} s; its trainer checks "
                          "the names as it loads the base (read again at the next submission)", kept=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode < 0:   # killed (out of memory?): not the config's fault, read again at the next submission
        return Unreadable(f"{config}: the process building its model on meta was killed (signal {-done.returncode}); "
                          "its trainer checks the names as it loads the base", kept=False)
    if done.returncode != 0 or not lines:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return Unreadable(f"{config}: its model could not be built from it ({why}); {FIX_CONFIG}")
    try:
        found = json.loads(lines[-1])
        return BaseLayers(tuple(found["linear"]), found["model_type"], tuple(found["unadapted"]))
    except (ValueError, KeyError, TypeError):   # something else printed last: the trainer checks the names
        return Unreadable(f"{config}: its check printed {lines[-1][:200]!r}, not the base's layers; its trainer "
                          "checks the names as it loads the base")


def checkpoint_layers(base_model: str) -> set[str] | None:
    """The names of the 2-D weights' modules in the base's safetensors files (their headers only, no torch): a
    folder's, or a GGUF file's converted folder where its trainer has built it. None where there are none to read,
    the base's config names experts (their layers may be ones aspen leaves alone: the full check says), or it is a
    GGUF file of an architecture aspen does not train from GGUF (a converted folder beside it or not: the full
    check refuses it)."""
    from actors.storage.gguf_header import ARCHITECTURES, read_header
    from actors.storage.sources import cache_root, converted_folder_path, resolve_source

    try:
        source = resolve_source(base_model)
        root = cache_root()
        folder = (Path(source.path) if source.gguf_file is None
                  else converted_folder_path(source, root) if root is not None else None)
        if folder is None or not folder.is_dir():
            return None
        if source.gguf_file is not None and str(read_header(Path(source.path) / source.gguf_file).architecture
                                                ) not in ARCHITECTURES:
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
