"""A GGUF base converted once into a Hugging Face folder, and read from there afterwards.

transformers reads a GGUF file by parsing and dequantizing it in Python, and does so three times for one base
(its config, its tokenizer, its weights): for smollm2-135m that took 30-90 s of CPU on 2 cores at every
trainer start, every `aspen run`, every export. The folder holds the same config, the same tokenizer and the
weights exactly as transformers dequantized them (float32), so a model loaded from it is bit for bit the model
read from the GGUF file (tests/slow/test_smollm2.py), in about a second.

Kept under `$ASPEN_CACHE_DIR/models` (default `$XDG_CACHE_HOME/aspen`, else `~/.cache/aspen`; `off` keeps
none), one folder per GGUF file named after the file, its size, its modification time and transformers'
version, so that a changed file or another dequantizer gets a new folder. One process builds a folder while
the others wait for it (a file lock); it appears whole or not at all (built aside, then renamed). Where it
cannot be written (a full disk, a read-only home) that is logged with the fix and the GGUF file is read
directly: slower, not wrong."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from actors.storage.durable import staging_folder
from actors.storage.sources import CACHE_ENV, ModelSource, cache_root, converted_folder_path

log = logging.getLogger(__name__)

def converted_source(source: ModelSource) -> ModelSource:
    """Where to read `source` from: for a GGUF file, its converted folder (built now if it is not there yet);
    anything else, or where no folder can be kept, `source` itself."""
    root = cache_root()
    if source.gguf_file is None or root is None:
        return source
    folder = converted_folder_path(source, root)
    if not (folder / "config.json").is_file():
        try:
            build(source, folder)
        except OSError as error:
            log.warning("could not keep the converted GGUF model in %s (%s); reading %s directly, as slowly as "
                        "every time (free space there, or set %s to a writable folder, or to 'off')",
                        folder, error, source.description, CACHE_ENV)
            return source
    return ModelSource(str(folder), None, True)


def build(source: ModelSource, folder: Path) -> None:
    """Convert the GGUF file of `source` into `folder` (config, tokenizer, float32 weights), unless another
    process did so while this one waited for the lock."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "config.json").is_file():
            return
        log.info("converting %s into %s once (later loads read the folder)", source.description, folder)
        kwargs = {"gguf_file": source.gguf_file, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
        model.hf_quantizer = None   # transformers keeps its GGUF 'quantizer' attached and refuses to save with it
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = staging_folder(folder.parent, f".{folder.name}.")
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
