"""An interactive model's saved state (the Tinker API's `save_weights`, what `load_weights` and
`create_training_client_from_state` read back): its adapter as PEFT's files (adapter_config.json,
adapter_model.safetensors: PEFT and vLLM load it as it is), AdamW's moments and step in
`optimizer.safetensors`, and `interactive_state.json` (rank, steps, base). Each file is written durably, the
folder complete before its path is answered; nothing is unpickled when read. The tensors are written from
their own memory, as a job's checkpoint is (actors/checkpoint/save.py). Saved sampler weights (PEFT's files and
aspen.json) are read back onto a base as a frozen adapter (`hold_sampler_weights`) for sampling sessions on a
model that has ended, or on a restarted server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from actors.checkpoint.initial_adapter import read_adapter_tensors, start_from_tensors
from actors.checkpoint.peft_io import METADATA_NAME, PREFIX, save_adapter
from actors.engine.adapter_surgery import AdapterHandle, add_adapter, remove_adapter
from actors.engine.interactive_model import InteractiveModel, interactive_lora, target_modules
from actors.engine.models import BaseModel
from actors.spec.model_parts import HEAD_MODULE
from actors.spec.saved_adapter import CONFIG_NAME, WEIGHTS_NAME, AdapterFileError
from actors.storage.base_identity import BaseIdentity, base_identity
from actors.storage.durable import replace_durably, staging_folder, write_durably

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "interactive_state.json"


def save_state(model: InteractiveModel, folder: str | Path, base_model: str, model_id: str, user: str,
               seq: int | None = None) -> Path:
    folder = Path(folder)
    identity = identity_of(model)
    save_adapter(model.adapter, folder, identity.serving_id, {"base_model": identity.metadata, "base_name": base_model,
                                                             "model_id": model_id, "user": user,
                                                             "lora_rank": model.rank,
                                                             "train_unembed": model.train_unembed})
    # from the moments' own memory (no copy, no bytes object: safetensors' save_file); called between steps
    # (the trainer's stepping thread), so nothing changes them during the write
    moments = model.optimizer_tensors(copy=False)
    write_durably(folder / OPTIMIZER_FILE, lambda tmp: save_file(moments, tmp))
    facts = {"rank": model.rank, "steps": model.steps, "user": user, "base_model": base_model, "model_id": model_id,
             "train_unembed": model.train_unembed}
    if seq is not None:   # a service's checkpoint: the seq_id of the call it was written after
        facts["seq"] = seq
    write_durably(folder / STATE_FILE, json.dumps(facts))
    return folder


CHECKPOINT_FOLDER = "checkpoint"


def write_checkpoint(model: InteractiveModel, job_dir: Path, base_model: str, model_id: str, user: str,
                     seq: int) -> Path:
    """A service's checkpoint of the model after its call `seq`, in `<job_dir>/checkpoint` (what `aspen export
    --checkpoint` exports): written whole in a staging folder, then put in place of the last one, which stays
    readable as `checkpoint.old` until then (`read_checkpoint` falls back to it)."""
    final, old = job_dir / CHECKPOINT_FOLDER, job_dir / f"{CHECKPOINT_FOLDER}.old"
    job_dir.mkdir(parents=True, exist_ok=True)
    partial = staging_folder(job_dir, f"{CHECKPOINT_FOLDER}.partial-")
    try:
        save_state(model, partial, base_model, model_id, user, seq)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        replace_durably(final, old)
    replace_durably(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def read_checkpoint(job_dir: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """The model's last checkpoint in `job_dir` (read_state's facts, weights and optimizer tensors; the facts
    with its `seq`), or None where it has none."""
    for name in (CHECKPOINT_FOLDER, f"{CHECKPOINT_FOLDER}.old"):
        if (job_dir / name / STATE_FILE).is_file():
            saved = read_state(job_dir / name)
            if isinstance(saved[0].get("seq"), int):
                return saved
    return None


def identity_of(model: InteractiveModel) -> BaseIdentity:
    """What the model's saved adapters record as their base (as a job's do: actors/storage/base_identity.py)."""
    base = model.base
    return base_identity(base.name, base.source, quantization=base.quantization,
                         dtype=str(base.dtype).removeprefix("torch."))


def base_name(facts: dict) -> str | None:
    """The base's name as the API serves it, from a save's facts (aspen.json or interactive_state.json)."""
    named = facts.get("base_name", facts.get("base_model"))
    return named if isinstance(named, str) else None


def read_state(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(its facts: rank, steps, base_model; its weights by the adapter's parameter names; its optimizer
    tensors). Raises FileNotFoundError or ValueError naming the file that is missing or wrong."""
    folder = Path(folder)
    try:
        facts = json.loads((folder / STATE_FILE).read_text())
        weights = {name.removeprefix(PREFIX): tensor
                   for name, tensor in load_file(folder / "adapter_model.safetensors").items()}
        optimizer = load_file(folder / OPTIMIZER_FILE)
    except FileNotFoundError as error:
        raise FileNotFoundError(f"{folder}: not a saved state ({Path(error.filename).name} is missing)") from None
    except (ValueError, OSError) as error:
        raise ValueError(f"{folder}: a saved state that cannot be read ({error})") from None
    if not isinstance(facts.get("rank"), int):
        raise ValueError(f"{folder / STATE_FILE}: no rank")
    return facts, weights, optimizer


def hold_sampler_weights(base: BaseModel, name: str, folder: str | Path) -> AdapterHandle:
    """Sampler weights saved in `folder` (`save_weights_for_sampler`: PEFT's files and aspen.json) attached to `base`
    as the frozen adapter `name`, as the model's own frozen copy was (`InteractiveModel.snapshot`: its rank from
    aspen.json, alpha 32, the layers adapter_config.json names: attention's, the MLP's, the LM head's). ValueError
    naming the file where they cannot be read or do not fit this base; nothing of them stays on it then."""
    folder = Path(folder)
    try:
        rank = json.loads((folder / METADATA_NAME).read_text())["lora_rank"]
        saved = json.loads((folder / CONFIG_NAME).read_text())
        leaves = {str(t).rsplit(".", 1)[-1] for t in saved["target_modules"]}
        stacks = bool(saved.get("target_parameters"))
    except FileNotFoundError as error:
        raise ValueError(f"{folder}: not saved sampler weights ({Path(error.filename).name} is missing)") from None
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ValueError(f"{folder}: saved sampler weights that cannot be read ({type(error).__name__}: {error}); "
                         "save them again") from None
    if not isinstance(rank, int):
        raise ValueError(f"{folder / METADATA_NAME}: lora_rank is {rank!r}, not a rank; save the weights again")
    attention = bool(leaves & set(target_modules(base, train_attn=True, train_mlp=False)))
    mlp = stacks or bool(leaves & set(target_modules(base, train_attn=False, train_mlp=True)))
    head = HEAD_MODULE in leaves
    if not (attention or mlp or head):
        raise ValueError(f"{folder / CONFIG_NAME}: its target_modules ({', '.join(sorted(leaves))}) name no linear "
                         f"layer of the base '{base.name}': the weights were saved on another base")
    config = interactive_lora(base, rank, train_attn=attention, train_mlp=mlp, train_unembed=head)
    if not stacks:   # saved before models trained an MoE base's experts, or on a dense base
        config = config.model_copy(update={"target_parameters": []})
    handle = add_adapter(base.model, name, config, seed=0, head=head)
    try:
        for parameter in handle.parameters():
            parameter.requires_grad_(False)
        start_from_tensors(handle, read_adapter_tensors(folder), str(folder / WEIGHTS_NAME))
    except AdapterFileError as error:
        remove_adapter(base.model, name)
        raise ValueError(f"sampler weights: {str(error).removeprefix('init_adapter: ')}") from None
    except BaseException:
        remove_adapter(base.model, name)
        raise
    return handle
