"""A saved adapter a job starts from (`init_adapter`): its folder's files read (a path or a storage URI) and its
`adapter_config.json` checked against the job's `lora`, torch-free, so that a jobs file or a submission is
refused at once, naming each setting that differs and the value to give.

A folder in PEFT's format is accepted from PEFT's `save_pretrained`, from an aspen job's `adapter/` or
`checkpoint/step-N/` folder, or from any tool that writes PEFT's files. What aspen cannot continue is refused:
another PEFT method than LoRA or VeRA, trained biases (`bias`, `lora_bias`), fully trained modules
(`modules_to_save`), per-module ranks or scalings (`rank_pattern`, `alpha_pattern`) and trainable token rows.
The weights themselves are checked where they are loaded (actors/checkpoint/initial_adapter.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema

from actors.spec.lora_config import LoraConfig
from actors.storage.storage_errors import StorageUnreachable
from actors.storage.storage_uri import StorageURI, as_location, is_uri

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
METADATA_NAME = "aspen.json"   # aspen's facts beside an adapter it saved: its base, job, step (base_identity.py)
"""The file names of an adapter folder in PEFT's format."""

PEFT_TYPES = {"lora": "LORA", "vera": "VERA"}
"""PEFT's `peft_type` of each adapter kind aspen trains."""

EMPTY_WHEN_CONTINUED = {
    "modules_to_save": "trains whole modules beside the adapter (e.g. lm_head), which aspen's shared base cannot",
    "rank_pattern": "gives some modules another rank than r",
    "alpha_pattern": "gives some modules another alpha than lora_alpha",
    "trainable_token_indices": "trains rows of the embedding matrix, which aspen's shared base cannot",
}
"""PEFT settings an adapter may hold only when empty (None, [] or {}), with why aspen cannot continue one."""


JOB_PREFIX = "job:"


class JobAdapter(str):
    """`init_adapter: job:<name>`: the adapter another job of the same submission (a jobs file, a batch over HTTP)
    ends with. The service enters it as `job:<that job's id>`, starts the job once that one has ended with an
    adapter, and from then on holds that adapter's path in its place (actors/service/scheduler/chained_jobs.py)."""

    @property
    def job(self) -> str:
        return self[len(JOB_PREFIX):]


def _adapter_source(value: Any) -> Path | StorageURI | JobAdapter:
    if isinstance(value, str) and value.startswith(JOB_PREFIX):
        name = value[len(JOB_PREFIX):]
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,71}$", name):
            raise ValueError(f"{value!r}: job: names another job of the same submission (job:<its name>), e.g. "
                             "job:sft")
        return JobAdapter(value)
    if not isinstance(value, (str, Path)):
        raise ValueError(f"expected a path, a storage URI (s3://bucket/prefix) or job:<name>, not "
                         f"{type(value).__name__}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("expected a path, a storage URI (s3://bucket/prefix) or job:<name>, not an empty string")
    return as_location(value)


AdapterSource = Annotated[Path | StorageURI | JobAdapter, PlainValidator(_adapter_source),
                          PlainSerializer(str, return_type=str),
                          WithJsonSchema({"type": "string",
                                          "description": "a path, a storage URI or job:<name of another job>"})]
"""Where a job's starting adapter comes from: a folder (a path or a storage URI), or `job:<name>` (`JobAdapter`)."""


def is_job_adapter(value: object) -> bool:
    """`init_adapter` names another job's adapter (also as the text a jobs file holds before validation)."""
    return isinstance(value, str) and value.startswith(JOB_PREFIX)


def saved_form(lora: LoraConfig) -> dict[str, Any]:
    """The adapter_config.json settings a job of this `lora` saves its adapter with (those `config_problems`
    compares): a PiSSA / OLoRA adapter is saved as PEFT's conversion to a plain LoRA of twice the rank (alpha
    doubled, times sqrt 2 with rsLoRA), as actors/checkpoint/peft_io.py writes it."""
    if lora.kind == "vera":
        return {"peft_type": "VERA", "r": lora.r, "projection_prng_key": lora.projection_prng_key,
                "save_projection": lora.save_projection}
    rank, alpha = lora.r, lora.alpha
    if lora.init_lora_weights.startswith(("pissa", "olora")):
        rank, alpha = 2 * rank, alpha * (2**0.5 if lora.use_rslora else 2)
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": lora.use_rslora,
            "use_dora": lora.use_dora}


def read_back_form(lora: LoraConfig) -> LoraConfig:
    """The adapter a saved folder of a job of this `lora` is read back into, frozen, to be used as saved ("try it"
    on a finished job): `saved_form`'s rank and alpha, no dropout, and (PiSSA / OLoRA's conversion being a plain
    LoRA on the untouched base) the default initialisation, which loading overwrites."""
    if lora.kind == "vera":
        return lora.model_copy(update={"dropout": 0.0})
    form = saved_form(lora)
    return lora.model_copy(update={"r": form["r"], "alpha": form["lora_alpha"], "dropout": 0.0,
                                   "init_lora_weights": "default"})


class AdapterFileError(ValueError):
    """The saved adapter cannot be read or does not fit the job; the message names the file, the setting and the fix."""


def adapter_file(location: str | Path, name: str) -> str:
    """Where a file of the adapter folder `location` is (a path or a URI), as messages show it."""
    return f"{str(location).rstrip('/')}/{name}" if is_uri(str(location)) else str(Path(location) / name)


def read_adapter_bytes(location: str | Path, name: str) -> bytes:
    """One file of the adapter folder: AdapterFileError naming it when it cannot be read."""
    where = adapter_file(location, name)
    try:
        if is_uri(str(location)):
            from actors.storage.storage_location import read_uri_bytes  # pyarrow: only where a URI is read

            return read_uri_bytes(where)
        return Path(where).read_bytes()
    except FileNotFoundError:
        raise AdapterFileError(f"init_adapter: {where} does not exist; give a folder holding {CONFIG_NAME} and "
                               f"{WEIGHTS_NAME} (PEFT's save_pretrained, or an aspen job's adapter/ folder)") from None
    except StorageUnreachable as error:   # not the adapter's fault: the job's start is tried again
        raise StorageUnreachable(f"init_adapter: {error}") from error
    except OSError as error:
        raise AdapterFileError(f"init_adapter: {where} cannot be read ({error})") from error


def read_adapter_config(location: str | Path | StorageURI) -> dict[str, Any]:
    """The adapter's `adapter_config.json` as a mapping: AdapterFileError when it is missing or not a JSON object."""
    raw = read_adapter_bytes(location, CONFIG_NAME)
    where = adapter_file(location, CONFIG_NAME)
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterFileError(f"init_adapter: {where} is not JSON ({error}); it is not an adapter's config") from None
    if not isinstance(config, dict):
        raise AdapterFileError(f"init_adapter: {where} holds a {type(config).__name__}, not an adapter's config "
                               "(a JSON object)")
    return config


def _empty(value: Any) -> bool:
    return value in (None, False, "none") or (isinstance(value, (list, dict, str)) and not value)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def config_problems(config: dict[str, Any], lora: LoraConfig) -> list[str]:
    """Each way the saved adapter's config differs from the job's `lora` (empty: it fits), as
    'lora.<field> is X, the adapter's <its key> Y' with the fix; settings aspen cannot continue, named."""
    peft_type = str(config.get("peft_type", "")).upper()
    expected = PEFT_TYPES[lora.kind]
    if peft_type != expected:
        kinds = {value: key for key, value in PEFT_TYPES.items()}
        if peft_type in kinds:
            return [f"the adapter is {peft_type} (peft_type) and the job's lora.kind is {lora.kind}; set lora.kind: "
                    f"{kinds[peft_type]}"]
        return [f"peft_type is {peft_type or 'missing'}: aspen continues LoRA and VeRA adapters only"]
    problems = []
    rank = config.get("r")
    if rank != lora.r:
        problems.append(f"lora.r is {lora.r}, the adapter's r {rank}: set lora.r: {rank}")
    if lora.kind == "lora":
        alpha = _number(config.get("lora_alpha"))
        if alpha is None or not math.isclose(alpha, lora.alpha, rel_tol=1e-9):
            problems.append(f"lora.alpha is {lora.alpha:g}, the adapter's lora_alpha {config.get('lora_alpha')}: "
                            f"set lora.alpha: {config.get('lora_alpha')}")
        for key in ("use_rslora", "use_dora"):
            saved = bool(config.get(key) or False)
            if saved != getattr(lora, key):
                problems.append(f"lora.{key} is {str(getattr(lora, key)).lower()}, the adapter's "
                                f"{str(saved).lower()}: set lora.{key}: {str(saved).lower()}")
        bias = config.get("bias", "none")
        if bias not in (None, "none"):
            problems.append(f"bias is {bias!r}: the adapter trains the base's biases, which aspen's shared base "
                            "cannot; continue it with PEFT, or save it with bias='none'")
        if config.get("lora_bias"):
            problems.append("lora_bias is true: the adapter has a trained bias in lora_B, which aspen does not train")
        stacks = sorted(config.get("target_parameters") or [])   # PEFT saves a set: in any order
        if stacks != sorted(lora.target_parameters):
            problems.append(f"lora.target_parameters is {lora.target_parameters}, the adapter's {stacks} (the expert "
                            f"stacks it adapts): set lora.target_parameters: {stacks}")
    elif config.get("save_projection") is False and config.get("projection_prng_key") != lora.projection_prng_key:
        key = config.get("projection_prng_key")
        problems.append(f"lora.projection_prng_key is {lora.projection_prng_key}, the adapter's {key} (its "
                        f"projections are not in the file, only drawn from that key): set lora.projection_prng_key: "
                        f"{key}")
    for key, why in EMPTY_WHEN_CONTINUED.items():
        if not _empty(config.get(key)):
            problems.append(f"{key} is {config[key]!r}: the adapter {why}")
    return problems


def check_adapter_config(location: str | Path | StorageURI, lora: LoraConfig) -> dict[str, Any]:
    """The adapter's config, checked against `lora`: AdapterFileError listing every problem, else the config."""
    config = read_adapter_config(location)
    problems = config_problems(config, lora)
    if problems:
        raise AdapterFileError(f"init_adapter: {adapter_file(location, CONFIG_NAME)} does not fit the job's lora: "
                               + "; ".join(problems))
    return config
