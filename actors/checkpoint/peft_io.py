"""Adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`, loadable
with `peft.PeftModel.from_pretrained` on the same (unmodified) base model.

DoRA adapters are written as PEFT writes them (`use_dora`, a `lora_magnitude_vector` per layer). PiSSA /
OLoRA adapters are written as PEFT's own conversion writes them (`save_pretrained(...,
path_initial_model_for_weight_conversion=...)`): the rank-2r LoRA A' = [A; A0], B' = [B, -B0] (r and alpha
doubled, so the scaling is unchanged; alpha times sqrt(2) with rslora), whose update on the unmodified base W
is scaling (B A - B0 A0): the trained adapter on PEFT's residual base. The file keeps every tensor the
adapter has, so a checkpoint restores A, B, A0 and B0 exactly from it (`load_adapter_state`).

VeRA adapters are written as PEFT's VeraModel writes them: `peft_type: VERA`, each layer's
`vera_lambda_b` / `vera_lambda_d` and, with `save_projection` (the default), the shared projections once, as
`base_model.vera_A` / `base_model.vera_B`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from actors.checkpoint.peft_names import CONFIG_NAME, METADATA_NAME, WEIGHTS_NAME
from actors.engine.adapter_surgery import AdapterHandle
from actors.engine.host_tensors import on_host
from actors.spec.lora_config import LoraConfig
from actors.storage.durable import write_durably


def import_peft() -> None:
    """Import PEFT now (what `peft_config_dict` needs at a job's first checkpoint). A trainer calls it while it
    loads its base: the import takes seconds (with bitsandbytes installed, PEFT imports it, and its import-time
    `torch.compile` decorators load inductor: 2-3 s on a 2-core CPU) and ~50 MiB resident, which then neither
    stall the first checkpoint's step nor escape the trainer's measurement of its runtime memory."""
    import peft  # noqa: F401  (the import is the point)


def converted(config: LoraConfig) -> bool:
    """Whether the adapter is saved as PEFT's rank-2r conversion (PiSSA / OLoRA: a frozen initial product)."""
    return config.init_lora_weights.startswith(("pissa", "olora"))


def peft_config_dict(config: LoraConfig, target_modules: list[str], base_model_name: str, *,
                     fan_in_fan_out: bool = False) -> dict:
    """What PEFT's `PeftModel.save_pretrained` writes as adapter_config.json for this adapter: a
    `peft.LoraConfig` of aspen's settings, as PEFT saves it (`inference_mode` on). `target_modules`: PEFT's
    names for exactly the adapted layers (AdapterHandle.peft_targets), kept in their (sorted) order where PEFT
    writes its set in any order. A PiSSA / OLoRA adapter is saved as PEFT's own conversion saves it (`converted`:
    rank and alpha doubled, `init_lora_weights` true, so that PEFT does not decompose the base again at load
    time); the other kinds keep their `init_lora_weights` (true for the default, `gaussian`). `fan_in_fan_out`: the
    adapted layers are GPT-2's Conv1D in the checkpoint (actors/engine/conv1d_layers.py), as PEFT marks them."""
    from peft import LoraConfig as PeftLoraConfig  # here, not at the top: importing PEFT takes seconds
    from peft import VeraConfig

    if config.kind == "vera":
        vera = VeraConfig(task_type="CAUSAL_LM", base_model_name_or_path=base_model_name, inference_mode=True,
                          r=config.r, target_modules=target_modules, projection_prng_key=config.projection_prng_key,
                          save_projection=config.save_projection, vera_dropout=config.dropout,
                          d_initial=config.d_initial, fan_in_fan_out=fan_in_fan_out)
        saved = vera.to_dict()
        saved["target_modules"] = list(target_modules)
        return saved
    rank, alpha, init = config.r, config.alpha, config.init_lora_weights
    if converted(config):   # as PeftModel.save_pretrained(..., path_initial_model_for_weight_conversion=...)
        rank, alpha, init = 2 * rank, alpha * (2**0.5 if config.use_rslora else 2), "default"
    peft_config = PeftLoraConfig(task_type="CAUSAL_LM", base_model_name_or_path=base_model_name, inference_mode=True,
                                 r=rank, lora_alpha=alpha, lora_dropout=config.dropout, use_rslora=config.use_rslora,
                                 target_modules=target_modules, use_dora=config.use_dora,
                                 init_lora_weights=True if init == "default" else init,
                                 target_parameters=list(config.target_parameters) or None,
                                 fan_in_fan_out=fan_in_fan_out)
    saved = peft_config.to_dict()
    saved["target_modules"] = list(target_modules)
    return saved


PREFIX = "base_model.model."
# VeRA's shared projections, once per adapter (PEFT's checkpoint keys, the adapter name stripped)
VERA_A, VERA_B = "base_model.vera_A", "base_model.vera_B"


def _projection_tensors(adapter: AdapterHandle, copy: bool) -> dict[str, torch.Tensor]:
    if adapter.projections is None or not adapter.config.save_projection:
        return {}
    return {VERA_A: on_host(adapter.projections.vera_A, torch.float32, copy=copy),
            VERA_B: on_host(adapter.projections.vera_B, torch.float32, copy=copy)}


def adapter_state_dict(adapter: AdapterHandle, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """PEFT's key names: `base_model.model.<module path>.lora_A.weight` (adapter name stripped), and with
    DoRA `....lora_magnitude_vector`; PiSSA / OLoRA layers as the rank-2r conversion [A; A0], [B, -B0].
    `copy`: every tensor a snapshot of its own (the default); False for a write that ends before the next step:
    a CPU adapter's float32 tensors are then the parameters themselves, not a second copy of the adapter."""
    tensors = {f"{PREFIX}{name}": on_host(param, torch.float32, copy=copy)
               for name, param in adapter.named_parameters()}
    for module_name, lora_a0, lora_b0 in adapter.frozen_initial():
        key_a, key_b = f"{PREFIX}{module_name}.lora_A.weight", f"{PREFIX}{module_name}.lora_B.weight"
        tensors[key_a] = torch.cat([tensors[key_a], lora_a0.detach().to("cpu", torch.float32)], dim=0)
        tensors[key_b] = torch.cat([tensors[key_b], -lora_b0.detach().to("cpu", torch.float32)], dim=1)
    tensors.update(_projection_tensors(adapter, copy))
    return tensors


def load_adapter_state(adapter: AdapterHandle, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy `adapter_state_dict`-form tensors into an attached adapter of the same config (the PiSSA /
    OLoRA conversion split back into A, B and the frozen A0, B0). ValueError naming `where` and the key
    for a missing tensor or a shape that does not fit."""
    expected = adapter_state_dict_shapes(adapter)
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"{where}: tensor '{key}' is missing; the adapter was saved with other target modules")
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{where}: '{key}' has shape {tuple(tensors[key].shape)}, the adapter {shape} "
                             "(another LoRA rank or init_lora_weights?)")
    if VERA_A in expected:
        _use_saved_projections(adapter, tensors[VERA_A], tensors[VERA_B])
    initial = {module_name: (a0, b0) for module_name, a0, b0 in adapter.frozen_initial()}
    with torch.no_grad():
        for name, param in adapter.named_parameters():
            value = tensors[f"{PREFIX}{name}"]
            module_name, _, kind = name.partition(".lora_")
            if module_name in initial and kind in ("A.weight", "B.weight"):
                lora_a0, lora_b0 = initial[module_name]
                rank = param.shape[0] if kind == "A.weight" else param.shape[1]
                if kind == "A.weight":
                    value, frozen = value[:rank], value[rank:]
                    lora_a0.copy_(frozen.to(lora_a0.device, lora_a0.dtype))
                else:
                    value, frozen = value[:, :rank], value[:, rank:]
                    lora_b0.copy_((-frozen).to(lora_b0.device, lora_b0.dtype))
            param.copy_(value.to(param.device, param.dtype))


def _use_saved_projections(adapter: AdapterHandle, vera_a: torch.Tensor, vera_b: torch.Tensor) -> None:
    """A saved VeRA adapter's projections: the ones `projection_prng_key` draws here (then nothing to do), or,
    drawn elsewhere to other values, that adapter's own copy (as PEFT loads them from the file)."""
    from actors.engine.vera import VeraProjections

    if adapter.projections is None or adapter.projections.equals(vera_a, vera_b):
        return
    device = adapter.projections.vera_A.device
    adapter.use_projections(VeraProjections(vera_a.to(device, torch.float32).clone(),
                                            vera_b.to(device, torch.float32).clone()))


def adapter_state_dict_shapes(adapter: AdapterHandle) -> dict[str, tuple[int, ...]]:
    """The keys and shapes `adapter_state_dict` writes for this adapter (without copying any tensor)."""
    shapes = {f"{PREFIX}{name}": tuple(param.shape) for name, param in adapter.named_parameters()}
    for module_name, lora_a0, lora_b0 in adapter.frozen_initial():
        key_a, key_b = f"{PREFIX}{module_name}.lora_A.weight", f"{PREFIX}{module_name}.lora_B.weight"
        shapes[key_a] = (shapes[key_a][0] + lora_a0.shape[0], shapes[key_a][1])
        shapes[key_b] = (shapes[key_b][0], shapes[key_b][1] + lora_b0.shape[1])
    if adapter.projections is not None and adapter.config.save_projection:
        shapes[VERA_A] = tuple(adapter.projections.vera_A.shape)
        shapes[VERA_B] = tuple(adapter.projections.vera_B.shape)
    return shapes


def save_adapter(adapter: AdapterHandle, folder: str | Path, base_model_name: str,
                 metadata: dict | None = None, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter atomically (each file written to a temporary name, then renamed). `base_model_name`:
    what `base_model_name_or_path` says (actors/storage/base_identity.py); `metadata`: aspen's own facts
    (where the base was loaded from, the job), written beside it as `aspen.json`, which PEFT and vLLM ignore.
    `tensors`: weights of this adapter's form saved earlier (`adapter_state_dict`: its best evaluation's) written
    in place of its current ones."""
    folder = Path(folder)
    if tensors is None:
        tensors = adapter_state_dict(adapter, copy=False)   # written before the caller's next step: no copy
    config = peft_config_dict(adapter.config, adapter.peft_targets, base_model_name,
                              fan_in_fan_out=adapter.fan_in_fan_out)
    # the mode any new file gets (0666 less the umask), as PEFT's save_pretrained writes them
    write_durably(folder / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if metadata is not None:
        write_durably(folder / METADATA_NAME, json.dumps(metadata, indent=2) + "\n")
    write_durably(folder / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def load_adapter_weights(adapter: AdapterHandle, folder: str | Path) -> None:
    """Copy saved PEFT-format weights into an attached adapter of the same shape."""
    path = Path(folder) / WEIGHTS_NAME
    load_adapter_state(adapter, load_file(str(path)), str(path))
