"""A LoRA adapter merged into its base one weight file at a time: what `PeftModel.merge_and_unload()` then
`save_pretrained` give, without building the model. Each safetensors file of the base's folder is read, the
adapter's update added into the weights it targets, and written under the same name beside the base's other files
(config, index, tokenizer), so the memory it takes is one file's, not the whole model's (an 8B base's 16 GB in
bfloat16 built in the process that merges: `aspen export --merge`, and the Tinker API's external weights in the
HTTP server's process).

The arithmetic is PEFT's merge on the CPU: the update `(B @ A) * scaling` in float32 (the adapter's own dtype,
PEFT's float32 adapters), added in place into the weight in the weight's dtype (computed in float32, rounded
once), so the merged weights equal PEFT's bit for bit (tests/unit/checkpoint/test_streamed_merge.py).

Only plain LoRA and rsLoRA adapters of the weights a base folder stores as safetensors are merged this way
(`reason_not`); DoRA, PiSSA / OLoRA, VeRA, bias and rank or alpha patterns, quantized bases and bases that are not
a local folder keep the model-building way (actors/checkpoint/adapter_export.py)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from actors.checkpoint.peft_names import CONFIG_NAME, WEIGHTS_NAME
from actors.storage.base_identity import METADATA_NAME

PREFIX = "base_model.model."
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")


def reason_not(adapter_dir: Path, base_folder: Path | None) -> str | None:
    """Why this adapter cannot be merged into this base file by file (None: it can)."""
    if base_folder is None or not base_folder.is_dir():
        return "the base is not a local folder"
    if not list(base_folder.glob("*.safetensors")) or list(base_folder.glob("*.bin")):
        return "the base's weights are not all safetensors"
    config = json.loads((base_folder / "config.json").read_text()) if (base_folder / "config.json").is_file() else {}
    if config.get("quantization_config"):
        return "the base is quantized"
    if isinstance(config.get("text_config"), dict):
        return "the base is a composite (vision-language) checkpoint, whose text model transformers renames as it loads"
    declared = config.get("dtype") or config.get("torch_dtype")
    if declared and _stored_dtype(base_folder) not in (None, declared):
        return f"the base stores {_stored_dtype(base_folder)} weights but declares {declared}"
    adapter = json.loads((adapter_dir / CONFIG_NAME).read_text())
    if adapter.get("peft_type") != "LORA" or adapter.get("use_dora"):
        return "not a plain LoRA adapter"
    if adapter.get("bias", "none") != "none" or adapter.get("fan_in_fan_out") or adapter.get("modules_to_save"):
        return "the adapter trains biases, transposed or other modules"
    if "lm_head" in (adapter.get("target_modules") or []) and "lm_head.weight" not in _stored_names(base_folder):
        return "the adapter adapts the LM head, which the base ties to its input embedding (merged untied)"
    if adapter.get("target_parameters"):
        return "the adapter adapts expert stacks, which transformers stacks only as it loads the model"
    if adapter.get("rank_pattern") or adapter.get("alpha_pattern") or adapter.get("layer_replication"):
        return "the adapter has rank or alpha patterns"
    if str(adapter.get("init_lora_weights", True)).lower().startswith(("pissa", "olora", "corda", "eva", "loftq")):
        return "the adapter's initialisation changed its base"
    return None


def _stored_names(base_folder: Path) -> set[str]:
    """The names of the weights the base's safetensors files store."""
    names: set[str] = set()
    for path in base_folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            names.update(reader.keys())
    return names


def _stored_dtype(base_folder: Path) -> str | None:
    """The dtype of the first floating-point weight the base's first weight file stores (as the config names it)."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    with safe_open(str(sorted(base_folder.glob("*.safetensors"))[0]), framework="pt") as reader:
        for name in reader.keys():
            stored = reader.get_slice(name).get_dtype()
            if stored in names:
                return names[stored]
    return None


def updates(adapter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The base weight each pair of the adapter updates: name -> (A, B, scaling)."""
    config = json.loads((adapter_dir / CONFIG_NAME).read_text())
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(adapter_dir / WEIGHTS_NAME))
    found: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(name.replace(".lora_A.weight", ".lora_B.weight"))
        if b is None:
            raise ValueError(f"{adapter_dir / WEIGHTS_NAME} has {name} but not its lora_B")
        found[f"{module}.weight"] = (a, b, scaling)
    return found


def merge_into(adapter_dir: Path, base_folder: Path, out: Path) -> Path:
    """Write the merged model into the empty folder `out`: each base weight file with the adapter's updates added,
    the base's other files copied. ValueError where a weight the adapter updates is not in the base."""
    pending = updates(adapter_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(base_folder.iterdir()):
        if path.is_file() and path.suffix == ".safetensors":
            _merge_file(path, pending, out / path.name)
        elif path.is_file() and path.suffix not in WEIGHT_FILES and not path.name.startswith(".") and \
                path.name != METADATA_NAME:   # (aspen's record of a checkpoint is not the merged model's)
            shutil.copy2(path, out / path.name)
    if pending:
        raise ValueError(f"the base in {base_folder} has no weight named {sorted(pending)[0]} that the adapter in "
                         f"{adapter_dir} updates ({len(pending)} missing): is it the adapter's base?")
    return out


def _merge_file(path: Path, pending: dict[str, tuple[torch.Tensor, torch.Tensor, float]], target: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as reader:
        metadata = reader.metadata() or {"format": "pt"}
        for name in reader.keys():
            weight = reader.get_tensor(name)
            if name in pending:
                a, b, scaling = pending.pop(name)
                if tuple(weight.shape) != (b.shape[0], a.shape[1]):
                    raise ValueError(f"{name} in {path} has shape {tuple(weight.shape)}; the adapter's update is "
                                     f"{(b.shape[0], a.shape[1])}: is it the adapter's base?")
                # PEFT's merge: the update in float32, added in float32 and rounded once to the weight's dtype
                weight = (weight + (b.float() @ a.float()) * scaling).to(weight.dtype)
            tensors[name] = weight
    save_file(tensors, str(target), metadata=metadata)
