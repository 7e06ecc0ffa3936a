"""What an interactive model's non-training calls do on its trainer, as plain records that cross processes (the
HTTP server -> its Ray connection -> the trainer): save its sampler weights (PEFT's files, and a frozen copy on
the base that sampling sessions sample), save its state (adapter and AdamW), load a saved state into it, pass
the place of a call the server refused. Each is called with the model, in the model's order of calls
(InteractiveCalls' "apply"), and returns what the call answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from actors.checkpoint.interactive_state import identity_of, save_state
from actors.checkpoint.peft_io import save_adapter
from actors.engine.adapter_surgery import remove_adapter
from actors.engine.interactive_model import InteractiveModel


@dataclass(frozen=True)
class SaveSampler:
    """`save_weights_for_sampler`: the adapter's files in `folder` (none where it is None: an ephemeral save, whose
    copy alone is sampled), and a frozen copy named `snapshot` on the base (none where `snapshot` is None; a copy
    of that name there already is replaced: the path's weights are the latest save's). Answers `path`."""

    folder: Path | None
    base_model: str
    model_id: str
    user: str
    path: str
    snapshot: str | None

    def __call__(self, model: InteractiveModel) -> str:
        if self.folder is not None:
            identity = identity_of(model)
            save_adapter(model.adapter, self.folder, identity.serving_id,
                         {"base_model": identity.metadata, "base_name": self.base_model, "model_id": self.model_id,
                          "user": self.user, "lora_rank": model.rank, "step": model.steps,
                          "train_unembed": model.train_unembed})
        if self.snapshot is not None:
            remove_adapter(model.base.model, self.snapshot)
            model.snapshot(self.snapshot)
        return self.path


@dataclass(frozen=True)
class SaveState:
    """`save_weights`: adapter, AdamW's moments and step in `folder`. Answers `path`."""

    folder: Path
    base_model: str
    model_id: str
    user: str
    path: str

    def __call__(self, model: InteractiveModel) -> str:
        save_state(model, self.folder, self.base_model, self.model_id, self.user)
        return self.path


@dataclass(frozen=True)
class LoadState:
    """`load_weights`: a saved state's weights into the model, and its optimizer's state (moments and step)
    where `optimizer` is given. Answers `model_id`."""

    model_id: str
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None
    steps: int

    def __call__(self, model: InteractiveModel) -> str:
        model.load(self.weights, self.optimizer)
        if self.optimizer is not None:
            model.steps = self.steps
        return self.model_id


@dataclass(frozen=True)
class Refused:
    """A call the HTTP server refused after its SDK had numbered it (its answer said why: `reason`): its place in
    the model's order, passed with nothing done, so that the model's later calls run. Answers None."""

    reason: str

    def __call__(self, model: InteractiveModel) -> None:
        return None
