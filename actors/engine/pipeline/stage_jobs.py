"""A job's share on one pipeline stage: its adapter over the stage's layers and that share's optimizer.

Set up from the head's `JobSetup` (resumed from an earlier run's state where it has one); the share's state
is read and loaded by parameter name, and stage 0 merges every stage's into the job's whole state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actors.engine.adapter_surgery import AdapterHandle, add_adapter
from actors.engine.optim import JobOptimizer
from actors.engine.pipeline.stage_messages import JobSetup
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.preference import reference_adapter_name
from actors.spec.job_spec import JobSpec


@dataclass(kw_only=True)
class StageJob:
    spec: JobSpec
    adapter: AdapterHandle
    optimizer: JobOptimizer | None   # None where this stage holds none of the job's layers
    reference: AdapterHandle | None = None   # its frozen reference adapter's share here (JobSetup.reference)

    @classmethod
    def set_up(cls, model: StageModel, setup: JobSetup) -> StageJob:
        """The job's adapter on this stage's layers, its optimizer, and its share of `setup.state` if any."""
        adapter = add_adapter(model.base.model, setup.spec.name, setup.spec.lora, seed=setup.seed)
        parameters = adapter.parameters()
        optimizer = (JobOptimizer(setup.spec, parameters, setup.total_steps,
                                  fast_parameters=adapter.parameter_groups()[1]) if parameters else None)
        job = cls(spec=setup.spec, adapter=adapter, optimizer=optimizer)
        if setup.state is not None:
            job.load(setup.state)
        if setup.reference is not None:
            job.reference = _reference_share(model, setup)
        return job

    def state(self) -> dict[str, Any]:
        """This stage's share: adapter tensors and AdamW moments by parameter name, the step counters."""
        names = [name for name, _ in self.adapter.named_parameters()]
        tensors = share_tensors(self.adapter)
        moments: dict[str, dict[str, torch.Tensor]] = {}
        counters = {"step_count": 0, "micro_count": 0}
        if self.optimizer is not None:
            by_id = {id(p): name for name, p in zip(names, self.adapter.parameters(), strict=True)}
            for parameter, state in self.optimizer.optimizer.state.items():
                moments[by_id[id(parameter)]] = {key: value.detach().cpu().clone() for key, value in state.items()}
            counters = {"step_count": self.optimizer.step_count, "micro_count": self.optimizer.micro_count}
        generator = self.adapter.dropout_generator
        return {"tensors": tensors, "moments": moments, **counters,
                "dropout_generator": generator.get_state().clone() if generator is not None else None}

    def load(self, state: dict[str, Any]) -> None:
        named = dict(self.adapter.named_parameters())
        if state.get("dropout_generator") is not None and self.adapter.dropout_generator is not None:
            self.adapter.dropout_generator.set_state(state["dropout_generator"])
        load_share_tensors(self.adapter, state["tensors"])
        for name, parameter in named.items():
            gradient = state.get("gradients", {}).get(name)   # resumed mid-accumulation
            parameter.grad = None if gradient is None else gradient.to(parameter.device, parameter.dtype)
        if self.optimizer is None:
            return
        for name, parameter in named.items():
            if name in state["moments"]:
                self.optimizer.optimizer.state[parameter] = {
                    key: value.to(parameter.device) if key != "step" else value.clone()
                    for key, value in state["moments"][name].items()}
        self.optimizer.group_lists.clear()   # the moments are new tensors now
        self.optimizer.step_count = state["step_count"]
        self.optimizer.micro_count = state["micro_count"]
        self.optimizer.set_lr()


def share_tensors(adapter: AdapterHandle) -> dict[str, torch.Tensor]:
    """An adapter's tensors on this stage by name, on the CPU: its parameters, and PiSSA / OLoRA's frozen A0, B0."""
    tensors = {name: p.detach().cpu().clone() for name, p in adapter.named_parameters()}
    for name, a0, b0 in adapter.frozen_initial():
        tensors[f"{name}.lora_A0"], tensors[f"{name}.lora_B0"] = a0.cpu().clone(), b0.cpu().clone()
    return tensors


def load_share_tensors(adapter: AdapterHandle, tensors: dict[str, torch.Tensor]) -> None:
    """`share_tensors`' form (the whole adapter's, or this stage's share) copied into the adapter's share here."""
    with torch.no_grad():
        for name, parameter in adapter.named_parameters():
            parameter.copy_(tensors[name])
        for name, a0, b0 in adapter.frozen_initial():
            a0.copy_(tensors[f"{name}.lora_A0"])
            b0.copy_(tensors[f"{name}.lora_B0"])


def _reference_share(model: StageModel, setup: JobSetup) -> AdapterHandle:
    """The job's frozen reference adapter over this stage's layers (no dropout, no gradients), its values those of
    `setup.reference` (the whole adapter's, by parameter name), as `job_references.JobReferences.hold` on one
    device."""
    name = reference_adapter_name(setup.spec.name)
    lora = setup.spec.lora.model_copy(update={"dropout": 0.0})
    reference = add_adapter(model.base.model, name, lora, seed=setup.seed)
    assert setup.reference is not None
    with torch.no_grad():
        for key, parameter in reference.named_parameters():
            parameter.copy_(setup.reference[key])
            parameter.requires_grad_(False)
    return reference


def merge_job_states(shares: list[dict[str, Any]]) -> dict[str, Any]:
    """A job's whole state from every stage's share (`StageJob.state`), stage 0's first: stage 0's dropout
    generator is the job's current one (the last stage's state came back with the results of the job's last
    micro-batch, taken before the shares were read)."""
    merged: dict[str, Any] = {"tensors": {}, "moments": {}, "step_count": shares[0]["step_count"],
                              "micro_count": shares[0]["micro_count"],
                              "dropout_generator": shares[0]["dropout_generator"]}
    for share in shares:
        merged["tensors"].update(share["tensors"])
        merged["moments"].update(share["moments"])
        if share["step_count"] or share["micro_count"]:
            merged["step_count"], merged["micro_count"] = share["step_count"], share["micro_count"]
    return merged
