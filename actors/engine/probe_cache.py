"""The memory probe's figures kept between trainer starts: `probe_base_activation` (actors/engine/memory_prior.py)
measures the same figures every time a trainer starts on the same base in the same setting, and on a CPU that is
most of the start (smollm2-135m on 2 cores: 39 s of probe steps after 1.5 s of loading). They are a property of
the model's shape, not its weights, so they are kept under the cache folder (`ASPEN_CACHE_DIR`, as converted GGUF
files are), in a file named by a digest of everything they depend on:

- the model: its class and its config (every shape, the attention kernel, tied embeddings), its dtype,
  quantization and fused kernels; the device (the GPU's name);
- the probe: layout, recompute mode, loss chunk;
- the software and the machine: torch's and transformers' versions, aspen's engine code (a digest of
  actors/engine's sources: a change to how a step runs changes what it holds), torch's thread count and the CPU
  (per-thread scratch, the kernels' vector width).

A file that cannot be read or does not hold what is expected is said (a warning naming it) and measured again,
then replaced; a folder that refuses the write is said, and the next start measures again. `ASPEN_CACHE_DIR=off`
keeps nothing."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import platform
from pathlib import Path
from typing import Any

import torch

from actors.engine.loss import DEFAULT_CHUNK
from actors.engine.memory import release_free_heap, resident_measurable
from actors.engine.memory_prior import BaseActivation, probe_base_activation
from actors.engine.models import BaseModel
from actors.storage.durable import write_durably
from actors.storage.sources import cache_root

log = logging.getLogger(__name__)

FORMAT = 1
ENGINE = Path(__file__).resolve().parent
# config entries that name where the model came from, not what it is
UNSHAPED_CONFIG_KEYS = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")


@functools.cache
def engine_code_digest() -> str:
    """A digest of aspen's engine sources (every .py file under actors/engine), read once per process."""
    digest = hashlib.sha256()
    for path in sorted(ENGINE.rglob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError as error:   # not Linux: the machine's architecture alone
        log.debug("no /proc/cpuinfo: %s", error)
    return platform.processor() or platform.machine()


def probe_key(base: BaseModel, *, layout: str, recompute: str, loss_chunk: int) -> dict[str, Any]:
    """Everything the probe's figures depend on (the module docstring), as JSON-ready values."""
    import transformers

    config = {k: v for k, v in base.model.config.to_dict().items() if k not in UNSHAPED_CONFIG_KEYS}
    device = base.device.type
    if device == "cuda":
        device = f"cuda: {torch.cuda.get_device_name(base.device)}"
    return {"format": FORMAT, "model": type(base.model).__name__, "config": config, "dtype": str(base.dtype),
            "quantization": base.quantization, "kernels": base.kernels, "device": device, "layout": layout,
            "recompute": recompute, "loss_chunk": loss_chunk, "torch": torch.__version__,
            "transformers": transformers.__version__, "engine": engine_code_digest(),
            "threads": torch.get_num_threads(), "cpu": _cpu_name()}


def _key_text(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, default=str)


def probe_path(key: dict[str, Any], root: Path) -> Path:
    return root / "memory-probes" / f"{hashlib.sha256(_key_text(key).encode()).hexdigest()[:24]}.json"


def _encoded(activation: BaseActivation) -> dict[str, Any]:
    fields = dataclasses.asdict(activation)
    groups = dict(fields["input_groups"])
    groups["no_grad"] = sorted(groups.get("no_grad", ()))
    fields["input_groups"] = groups
    return fields


def _decoded(fields: Any) -> BaseActivation:
    """The saved figures back, or ValueError saying what is wrong with them."""
    names = {field.name for field in dataclasses.fields(BaseActivation)}
    if not isinstance(fields, dict) or set(fields) != names:
        raise ValueError(f"its figures are not {sorted(names)}")
    numbers = {name: fields[name] for name in names - {"input_groups", "layers"}}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} is {value!r}, not a finite number")
    groups, layers = fields["input_groups"], fields["layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers is {layers!r}, not a positive whole number")
    if (not isinstance(groups, dict) or not isinstance(groups.get("no_grad"), list)
            or not all(isinstance(v, int) and not isinstance(v, bool) for k, v in groups.items() if k != "no_grad")):
        raise ValueError("input_groups is not a map of layer names to group numbers with a no_grad list")
    return BaseActivation(**{**numbers, "layers": layers,
                             "input_groups": {**groups, "no_grad": frozenset(groups["no_grad"])}})


def _read(path: Path, key: dict[str, Any]) -> BaseActivation | None:
    """The figures kept at `path` for `key`; None (and a warning where a file was there) when they cannot be used."""
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        log.warning("%s: the memory probe's kept figures cannot be read (%s); measuring them again", path, error)
        return None
    try:
        if not isinstance(saved, dict) or _key_text(saved.get("key")) != _key_text(key):
            raise ValueError("they were measured for another model or setting (the file's name collides)")
        return _decoded(saved.get("activation"))
    except ValueError as error:
        log.warning("%s: the memory probe's kept figures are not usable: %s; measuring them again", path, error)
        return None


def cached_probe(base: BaseModel, *, layout: str = "packed", recompute: str = "none",
                 loss_chunk: int = DEFAULT_CHUNK) -> BaseActivation:
    """`probe_base_activation(base, ...)`, from the cache folder where an earlier start kept it for the same model and
    setting (the module docstring), else measured and kept there."""
    root = cache_root()
    if root is None:
        return probe_base_activation(base, layout=layout, recompute=recompute, loss_chunk=loss_chunk)
    key = probe_key(base, layout=layout, recompute=recompute, loss_chunk=loss_chunk)
    path = probe_path(key, root)
    activation = _read(path, key)
    if activation is not None:
        log.info("memory probe of %s: its figures kept in %s", base.name, path)
        if base.device.type == "cpu" and resident_measurable():
            release_free_heap()   # as the probe ends: the resident set is then what is live
        return activation
    activation = probe_base_activation(base, layout=layout, recompute=recompute, loss_chunk=loss_chunk)
    try:
        write_durably(path, json.dumps({"key": key, "activation": _encoded(activation)}, indent=1, default=str) + "\n")
    except OSError as error:
        log.warning("%s: the memory probe's figures could not be kept (%s); the next trainer start measures them "
                    "again (set %s to a writable folder, or to off)", path, error, "ASPEN_CACHE_DIR")
    return activation
