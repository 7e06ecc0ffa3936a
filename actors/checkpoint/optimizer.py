"""A job optimizer's state as format 2 stores it: state.json's `optimizer` section plus named tensors in
optimizer.safetensors, and back to `JobOptimizer.state_dict()` form."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from actors.checkpoint.state import Invalid, OptimizerSection
from actors.engine.host_tensors import on_host
from actors.engine.job import TrainingJob


def encode_optimizer(job: TrainingJob, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The optimizer's state as JSON, its tensors added to `tensors` (on the CPU): a CPU job's moments and
    gradients are added as they are, not copied (`on_host`), for a write that ends before the job's next step."""
    full = job.optimizer.state_dict()
    torch_state = full["optimizer"]
    param_groups = []
    for g, group in enumerate(torch_state["param_groups"]):
        param_groups.append({key: encode_value(value, f"param_groups.{g}.{key}", tensors)
                             for key, value in group.items()})
    state_tensors: dict[str, list[str]] = {}
    state_values: dict[str, dict[str, Any]] = {}
    for param_id, entries in torch_state["state"].items():
        names, values = [], {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param_id}.{key}"] = on_host(value, copy=False)
                names.append(key)
            else:
                values[key] = encode_value(value, f"state.{param_id}.{key}", tensors)
        state_tensors[str(param_id)] = names
        state_values[str(param_id)] = values
    gradients = []
    for i, parameter in enumerate(job.adapter.parameters()):
        gradients.append(parameter.grad is not None)
        if parameter.grad is not None:
            tensors[f"grad.{i}"] = on_host(parameter.grad, copy=False)
    encoded = {"step_count": full["step_count"], "micro_count": full["micro_count"], "param_groups": param_groups,
               "state_tensors": state_tensors, "state_values": state_values, "gradients": gradients}
    if "loss_scale" in full:   # float16 bases: the job's dynamic loss scale
        encoded["loss_scale"] = full["loss_scale"]
    return encoded


def encode_value(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for an optimizer setting: tuples tagged {"tuple": [...]}, tensors stored under `name`."""
    if isinstance(value, torch.Tensor):
        tensors[name] = on_host(value)   # a setting (a step count): small, copied
        return {"tensor": name}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"optimizer value {name} = {value!r} ({type(value).__name__}) cannot be written to a "
                    "checkpoint: only numbers, strings, booleans, None, tuples, lists and tensors can")


def decode_optimizer(state_path: Path, tensors_path: Path, encoded: OptimizerSection,
                     tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], list[torch.Tensor | None]]:
    """Rebuild JobOptimizer.state_dict() and the gradient list from state.json's validated "optimizer"
    section and the tensors; every tensor in the file must be accounted for, and every one listed exist."""
    used: set[str] = set()

    def tensor(name: str) -> torch.Tensor:
        if name not in tensors:
            raise Invalid(f"{tensors_path}: tensor '{name}' is missing (state.json lists it)")
        used.add(name)
        return tensors[name]

    def decode(value: Any, where: str) -> Any:
        if isinstance(value, list):
            return [decode(v, where) for v in value]
        if isinstance(value, dict):
            if set(value) == {"tuple"} and isinstance(value["tuple"], list):
                return tuple(decode(v, where) for v in value["tuple"])
            if set(value) == {"tensor"} and isinstance(value["tensor"], str):
                return tensor(value["tensor"])
            raise Invalid(f"{state_path}: optimizer.{where}: unknown encoded value {value!r}")
        return value

    param_groups = [{key: decode(value, f"param_groups[{g}].{key}") for key, value in group.items()}
                    for g, group in enumerate(encoded.param_groups)]
    torch_state: dict[int, dict[str, Any]] = {}
    for key, names in encoded.state_tensors.items():
        entries = {name: tensor(f"state.{key}.{name}") for name in names}
        entries.update({name: decode(value, f"state_values[\"{key}\"].{name}")
                        for name, value in encoded.state_values[key].items()})
        torch_state[int(key)] = entries
    gradients = [tensor(f"grad.{i}") if saved else None for i, saved in enumerate(encoded.gradients)]
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise Invalid(f"{tensors_path}: tensors state.json does not list: {', '.join(unexpected[:5])}"
                      f"{' ...' if len(unexpected) > 5 else ''}")
    optimizer: dict[str, Any] = {"optimizer": {"state": torch_state, "param_groups": param_groups},
                                 "step_count": encoded.step_count, "micro_count": encoded.micro_count}
    if encoded.loss_scale is not None:
        optimizer["loss_scale"] = encoded.loss_scale.model_dump()
    return optimizer, gradients
