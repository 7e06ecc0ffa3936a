"""An interactive model's saved state (the Tinker API's `save_weights`, what `load_weights` and
`create_training_client_from_state` read back): its adapter as PEFT's files (adapter_config.json,
adapter_model.safetensors: PEFT and vLLM load it as it is), AdamW's moments and step in
`optimizer.safetensors`, and `interactive_state.json` (rank, steps, base). Each file is written durably, the
folder complete before its path is answered; nothing is unpickled when read. The tensors are written from
their own memory, as a job's checkpoint is (actors/checkpoint/save.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from actors.checkpoint.peft_io import PREFIX, save_adapter
from actors.engine.interactive_model import InteractiveModel
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
                                                             "lora_rank": model.rank})
    # from the moments' own memory (no copy, no bytes object: safetensors' save_file); called between steps
    # (the trainer's stepping thread), so nothing changes them during the write
    moments = model.optimizer_tensors(copy=False)
    write_durably(folder / OPTIMIZER_FILE, lambda tmp: save_file(moments, tmp))
    facts = {"rank": model.rank, "steps": model.steps, "user": user, "base_model": base_model, "model_id": model_id}
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
