"""The lines that load or serve an adapter, written to run as shown on the machine that trained it.

An adapter's `adapter_config.json` names the base by an id a serving engine resolves elsewhere (the hub id
of the embedded default, `HuggingFaceTB/SmolLM2-135M-Instruct`), which a machine without internet cannot
fetch. The lines here name the base where this machine has it instead (`aspen.json` beside the adapter:
the folder, or a GGUF file's converted folder, or the GGUF file itself with `gguf_file=`), and say what
to write on another machine: the recorded id.

- `peft`: Python that loads the base with transformers and the adapter with PEFT (tested by running it
  against an exported folder: tests/slow/test_smollm2.py);
- `vllm`: `vllm serve BASE --enable-lora --max-lora-rank R --lora-modules NAME=FOLDER` (vLLM needs a model
  folder: for a GGUF base without a converted folder it is `None`, and `elsewhere` says to merge instead)."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actors.storage.sources import ModelSource, cache_root, converted_folder_path

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for --max-lora-rank (its default is 16)."""


@dataclass(frozen=True)
class ServingLines:
    base: str                  # where this machine has the base (a folder, or the folder of a GGUF file)
    gguf_file: str | None      # the GGUF file inside `base` where no converted folder exists
    serving_id: str            # the id adapter_config.json records (what another machine loads)
    peft: str                  # Python: the base with transformers, the adapter with PEFT
    vllm: str | None           # a shell line, or None where vLLM cannot read this machine's copy of the base
    elsewhere: str             # what to change on another machine

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_base(source: ModelSource) -> tuple[str, str | None]:
    """(folder, GGUF file or None) to load `source` from with transformers: a GGUF file's converted folder
    where aspen keeps one (actors/storage/gguf_cache.py), else the file itself."""
    if source.gguf_file is None:
        return source.path, None
    root = cache_root()
    if root is not None:
        folder = converted_folder_path(source, root)
        if (folder / "config.json").is_file():
            return str(folder), None
    return source.path, source.gguf_file


def vllm_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]})")


def serving_lines(source: ModelSource, serving_id: str, adapter_folder: Path | str, name: str,
                  rank: int, vllm_refusal: str | None = None, exported: str | None = None) -> ServingLines:
    """The lines for the adapter in `adapter_folder` (written there, or to be written when the job ends),
    trained on the base loaded from `source`, whose config records `serving_id`; `vllm_refusal`: why vLLM
    cannot serve this kind of adapter (None: it can); `exported`: what `aspen export` takes to merge it (default
    `name`, a job's name)."""
    folder, gguf_file = local_base(source)
    adapter_folder = str(adapter_folder)
    local_only = source.local_files_only and not Path(folder).is_dir()   # a hub id from the local cache
    arguments = [repr(folder)]
    if gguf_file:
        arguments.append(f"gguf_file={gguf_file!r}")
    if local_only:
        arguments.append("local_files_only=True")
    load = ", ".join(arguments)
    peft = ("from peft import PeftModel\n"
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"base = AutoModelForCausalLM.from_pretrained({load})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({load})\n"
            f"model = PeftModel.from_pretrained(base, {adapter_folder!r})\n")
    vllm = None
    if gguf_file is None and vllm_refusal is None:
        vllm = (f"vllm serve {folder} --enable-lora --max-lora-rank {vllm_rank(rank)} "
                f"--lora-modules {name}={adapter_folder}")
    if serving_id != folder:
        elsewhere = (f"On another machine, load the base by the id the adapter records, {serving_id} "
                     f"(adapter_config.json's base_model_name_or_path), instead of {folder}.")
    else:
        elsewhere = f"On another machine, copy the base ({folder}) along with the adapter, or give its path there."
    merge = (f"`aspen export {exported or name} --merge` writes the base with the adapter merged into it, which "
             "`vllm serve FOLDER` serves.")
    if vllm_refusal is not None:
        elsewhere += f" {vllm_refusal}: {merge}"
    elif vllm is None:
        elsewhere += f" vLLM needs a model folder: {merge}"
    return ServingLines(folder, gguf_file, serving_id, peft, vllm, elsewhere)


def adapter_serving_lines(adapter_folder: Path, name: str | None = None) -> ServingLines:
    """The lines for an adapter folder aspen wrote (its config and `aspen.json` say the rest)."""
    from actors.checkpoint.adapter_export import base_source, serving_id

    adapter_folder = Path(adapter_folder)
    config = json.loads((adapter_folder / "adapter_config.json").read_text())
    return serving_lines(base_source(adapter_folder), serving_id(adapter_folder), adapter_folder.resolve(),
                         name or adapter_folder.name, int(config.get("r") or 8), vllm_cannot_serve(config),
                         None if name else shlex.quote(str(adapter_folder.resolve())))   # the folder itself


def vllm_cannot_serve(config: dict[str, Any]) -> str | None:
    """Why vLLM's --lora-modules cannot serve an adapter of this PEFT config, or None."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"vLLM serves LoRA adapters, not {config['peft_type']}"
    if config.get("use_dora"):
        return "vLLM does not serve DoRA adapters"
    return None
