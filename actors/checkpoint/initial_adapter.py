"""A job's adapter started from saved weights (`init_adapter`): the folder's config checked against the job's
`lora` (actors/spec/saved_adapter.py), its tensors against the adapter's (the same modules, each of its shape,
every value finite), then copied in. Nothing of the job changes unless every check passes.

The tensors are PEFT's (`base_model.model.<module>.lora_A.weight`, DoRA's `lora_magnitude_vector`, VeRA's
`vera_lambda_b` / `vera_lambda_d` and shared projections), in any floating dtype: they become the job's float32
masters. The optimizer and the learning-rate schedule start afresh, as a PEFT model loaded with
`is_trainable=True` starts under a new trainer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from actors.checkpoint.peft_io import VERA_A, VERA_B, adapter_state_dict_shapes, load_adapter_state
from actors.engine.adapter_surgery import AdapterHandle
from actors.spec.saved_adapter import (
    WEIGHTS_NAME,
    AdapterFileError,
    JobAdapter,
    adapter_file,
    check_adapter_config,
    read_adapter_bytes,
)
from actors.storage.storage_uri import StorageURI


def _modules(keys: list[str]) -> str:
    """The kinds of module among PEFT keys (`q_proj`, `down_proj`), for a message."""
    names = sorted({key.split(".lora_")[0].split(".vera_")[0].rsplit(".", 1)[-1] for key in keys})
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def read_adapter_tensors(location: str | Path | StorageURI) -> dict[str, torch.Tensor]:
    """The adapter's `adapter_model.safetensors`: AdapterFileError when it cannot be read or parsed."""
    raw = read_adapter_bytes(location, WEIGHTS_NAME)
    try:
        return load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise AdapterFileError(f"init_adapter: {adapter_file(location, WEIGHTS_NAME)} is not a safetensors file "
                               f"({error}); save the adapter again") from None


def check_adapter_tensors(tensors: dict[str, torch.Tensor], adapter: AdapterHandle, where: str) -> None:
    """The saved tensors are the adapter's: the same keys (the same adapted modules), each of its shape, floating
    and finite. VeRA's projections may be absent (PEFT's save_projection false: drawn again from the key)."""
    expected = adapter_state_dict_shapes(adapter)
    optional = {VERA_A, VERA_B} if adapter.projections is not None else set()
    missing = [key for key in expected if key not in tensors and key not in optional]
    extra = [key for key in tensors if key not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the job adapts {_modules(missing)} where the adapter has no weights ({len(missing)} "
                         f"tensors, e.g. {missing[0]})")
        if extra:
            parts.append(f"the adapter has weights for {_modules(extra)} the job does not adapt ({len(extra)} "
                         f"tensors, e.g. {extra[0]})")
        raise AdapterFileError(f"init_adapter: {where}: {'; '.join(parts)}; set lora.target_modules to the "
                               "adapter's modules (its adapter_config.json's target_modules)")
    for key, shape in expected.items():
        if key not in tensors:
            continue
        value = tensors[key]
        if tuple(value.shape) != shape:
            raise AdapterFileError(f"init_adapter: {where}: '{key}' has shape {tuple(value.shape)}, the job's adapter "
                                   f"{shape}: the adapter was trained on a base of another shape (base_model)")
        if not value.is_floating_point():
            raise AdapterFileError(f"init_adapter: {where}: '{key}' holds {value.dtype}, not floating-point weights")
        if not bool(torch.isfinite(value).all()):
            raise AdapterFileError(f"init_adapter: {where}: '{key}' holds non-finite values (inf or nan): the "
                                   "adapter's training diverged; start from an earlier checkpoint of it")


def start_from_adapter(adapter: AdapterHandle, location: str | Path | StorageURI) -> str:
    """Copy the saved adapter at `location` into `adapter` (attached, of the job's `lora`), after checking it;
    AdapterFileError (adapter untouched) when it cannot be read or does not fit. Returns a note for the job's
    record: where it started from."""
    if isinstance(location, JobAdapter):   # the service replaces it by that job's folder before the job starts
        raise AdapterFileError(f"init_adapter: {location} names a job whose adapter this one was started without; "
                               "submit it again")
    check_adapter_config(location, adapter.config)
    start_from_tensors(adapter, read_adapter_tensors(location), str(adapter_file(location, WEIGHTS_NAME)))
    return f"its adapter started from {location}"


def start_from_tensors(adapter: AdapterHandle, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy PEFT's tensors of an adapter of the same config (read from `where`) into `adapter`, after checking
    them (check_adapter_tensors); AdapterFileError, adapter untouched, when they do not fit."""
    check_adapter_tensors(tensors, adapter, where)
    if adapter.projections is not None and VERA_A not in tensors:   # drawn again from the same key (config checked)
        tensors = {**tensors, VERA_A: adapter.projections.vera_A, VERA_B: adapter.projections.vera_B}
    load_adapter_state(adapter, tensors, where)
