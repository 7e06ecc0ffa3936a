"""Adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`, loadable
with `peft.PeftModel.from_pretrained` on the same base model."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from actors.engine.lora import AdapterHandle
from actors.engine.spec import LoraConfig

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
METADATA_NAME = "aspen.json"


def peft_config_dict(config: LoraConfig, target_modules: list[str], base_model_name: str) -> dict:
    """`target_modules`: PEFT's names for exactly the adapted layers (AdapterHandle.peft_targets)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "use_rslora": config.use_rslora,
        "target_modules": target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "revision": None,
    }


def _atomic_write(path: Path, write) -> None:
    """Write `path` through a temporary file: its content is fsynced before the rename, and the folder
    after it, so that after a crash `path` holds either the old or the complete new content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(temporary)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def adapter_state_dict(adapter: AdapterHandle) -> dict[str, torch.Tensor]:
    """PEFT's key names: `base_model.model.<module path>.lora_A.weight` (adapter name stripped)."""
    return {f"base_model.model.{name}": param.detach().to("cpu", torch.float32).contiguous().clone()
            for name, param in adapter.named_parameters()}


def save_adapter(adapter: AdapterHandle, folder: str | Path, base_model_name: str,
                 metadata: dict | None = None) -> Path:
    """Write the adapter atomically (each file written to a temporary name, then renamed). `base_model_name`:
    what `base_model_name_or_path` says (actors/engine/base_identity.py); `metadata`: aspen's own facts
    (where the base was loaded from, the job), written beside it as `aspen.json`, which PEFT and vLLM ignore."""
    folder = Path(folder)
    tensors = adapter_state_dict(adapter)
    config = peft_config_dict(adapter.config, adapter.peft_targets, base_model_name)
    _atomic_write(folder / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if metadata is not None:
        _atomic_write(folder / METADATA_NAME, lambda tmp: Path(tmp).write_text(json.dumps(metadata, indent=2) + "\n"))
    _atomic_write(folder / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    return folder


def load_adapter_weights(adapter: AdapterHandle, folder: str | Path) -> None:
    """Copy saved PEFT-format weights into an attached adapter of the same shape."""
    path = Path(folder) / WEIGHTS_NAME
    tensors = load_file(str(path))
    expected = dict(adapter.named_parameters())
    for name, param in expected.items():
        key = f"base_model.model.{name}"
        if key not in tensors:
            raise ValueError(f"{path}: tensor '{key}' is missing; the adapter was saved with other target modules")
        with torch.no_grad():
            param.copy_(tensors[key].to(param.device, param.dtype))
