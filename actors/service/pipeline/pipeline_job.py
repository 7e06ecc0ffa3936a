"""A job on a pipeline trainer (`PipelineJob`), as the trainer loop and the checkpoint code use a
`TrainingJob`, and its mirror on this process's CPU.

The mirror is the job's whole adapter and AdamW state as a `TrainingJob` would hold them, filled from the
stages when read (`PipelineJob.adapter`, `.optimizer`), and given back to them after a checkpoint is loaded
into it. Checkpoints and adapters are therefore written and read by the same code, in the same format, as on
one device: a job checkpointed on a pipeline resumes on one device and the other way round. (The trainer that
holds these jobs: pipeline_engine.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from actors.data import Example
from actors.engine.adapter_surgery import AdapterHandle
from actors.engine.grpo_replay import GrpoReplay
from actors.engine.job import BatchSource, OptimizerStepRecord, StepAccumulator, continue_plan
from actors.engine.kept_best import KeptBest
from actors.engine.optim import JobOptimizer
from actors.engine.pipeline.head_jobs import HeadJob
from actors.service.pipeline.pipeline_processes import LocalPipeline
from actors.spec.job_spec import JobSpec


class JobStages(Protocol):
    """What a job's mirror needs of its trainer (`PipelineEngine`, pipeline_engine.py): the stages, called
    through its guard against a lost stage, the base's linear layers in the model's order, and the job's PEFT
    targets."""

    pipeline: LocalPipeline
    module_order: list[str]

    def _guarded(self, call: Callable, *args, **kwargs): ...

    def peft_targets(self, name: str) -> list[str]: ...


class MirrorLayer(nn.Module):
    """One layer's share of a job's adapter on the CPU: the tensors `AdapterHandle` names (A, B, DoRA's
    magnitude, PiSSA / OLoRA's frozen A0 and B0), nothing to compute with."""

    def __init__(self, tensors: dict[str, torch.Tensor], module: str):
        super().__init__()
        self.lora_A = nn.Parameter(tensors[f"{module}.lora_A.weight"].clone())
        self.lora_B = nn.Parameter(tensors[f"{module}.lora_B.weight"].clone())
        magnitude = tensors.get(f"{module}.lora_magnitude_vector")
        self.magnitude = nn.Parameter(magnitude.clone()) if magnitude is not None else None
        self.lora_A0 = tensors.get(f"{module}.lora_A0")
        self.lora_B0 = tensors.get(f"{module}.lora_B0")


def mirror_adapter(name: str, spec: JobSpec, state: dict, module_order: list[str], peft_targets: list[str],
                   ) -> AdapterHandle:
    """The job's whole adapter on the CPU from its gathered `state`, its layers in the model's order (the
    order a single device's adapter has, so that its optimizer state numbers its tensors alike)."""
    tensors = state["tensors"]
    modules = [module for module in module_order if f"{module}.lora_A.weight" in tensors]
    layers = {module: MirrorLayer(tensors, module) for module in modules}
    generator = None
    if state.get("dropout_generator") is not None:
        generator = torch.Generator()
        generator.set_state(state["dropout_generator"])
    return AdapterHandle(name, spec.lora, layers, generator, peft_targets)   # type: ignore[arg-type]


class PipelineJob:
    """A job on a pipeline trainer as the trainer loop and the checkpoint code use a `TrainingJob`: its
    counters, data and history are the head's (`HeadJob`); `adapter` and `optimizer` are its CPU mirror,
    brought up to date from the stages when read after a step."""

    def __init__(self, engine: JobStages, head: HeadJob, eval_examples: list[Example], seed: int):
        self.engine = engine
        self.head = head
        self.eval_examples = eval_examples
        self.seed = seed
        self.evals: list[tuple[int, float]] = []
        self.scores: list[tuple[int, float]] = []   # eval_generate is refused on pipeline trainers (attach)
        self.data_digest: str | None = None
        self.best: KeptBest | None = None   # the adapter of its best evaluation, with keep_best
        self.cursor_state_before_pending: dict | None = None
        self._adapter: AdapterHandle | None = None
        self._optimizer: JobOptimizer | None = None
        self.stale = True

    # -- what the loop reads ------------------------------------------------------------------------
    @property
    def spec(self) -> JobSpec:
        return self.head.spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cursor(self) -> BatchSource:
        return self.head.cursor

    @property
    def total_steps(self) -> int:
        return self.head.total_steps

    @total_steps.setter
    def total_steps(self, value: int) -> None:
        self.head.total_steps = value

    def plan_to(self, total_steps: int) -> None:
        """`TrainingJob.plan_to` on the mirror (the stages take it with the job's state when it is `restored`)."""
        continue_plan(self, self.optimizer, total_steps)

    @property
    def step(self) -> int:
        return len(self.head.history)

    @property
    def done(self) -> bool:
        return self.head.done

    @property
    def replay(self) -> GrpoReplay | None:
        """A GRPO job's generation trained on num_iterations times: the head's (it composes the replays)."""
        return self.head.replay

    @replay.setter
    def replay(self, value: GrpoReplay | None) -> None:   # a checkpoint's, loaded (checkpoint/load.py)
        self.head.replay = value

    def peek(self) -> list[Example] | None:
        """The job's next micro-batch (its data is asked for only when the job may still plan a step)."""
        limit = self.head.step_limit
        self.head.step_limit = None
        try:
            return self.head.peek()
        finally:
            self.head.step_limit = limit

    def data_position(self) -> dict:
        return self.head.data_position()

    @property
    def pending(self) -> list[Example] | None:
        return self.head.pending

    @pending.setter
    def pending(self, value: list[Example] | None) -> None:
        self.head.pending = value

    @property
    def history(self) -> list[OptimizerStepRecord]:
        return self.head.history

    @history.setter
    def history(self, value: list[OptimizerStepRecord]) -> None:
        self.head.history = value

    @property
    def tokens_seen(self) -> int:
        return self.head.tokens_seen

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self.head.tokens_seen = value

    @property
    def accumulator(self) -> StepAccumulator:
        return self.head.accumulator

    @accumulator.setter
    def accumulator(self, value: StepAccumulator) -> None:
        self.head.accumulator = value

    # -- the mirror ---------------------------------------------------------------------------------
    @property
    def adapter(self) -> AdapterHandle:
        self.sync()
        assert self._adapter is not None
        return self._adapter

    @property
    def optimizer(self) -> JobOptimizer:
        self.sync()
        assert self._optimizer is not None
        return self._optimizer

    def sync(self) -> None:
        """Bring the mirror up to date with the stages (nothing is in flight between loop steps)."""
        if not self.stale:
            return
        state = self.engine._guarded(lambda: self.engine.pipeline.job_state(self.name))
        if self._adapter is None:
            self._adapter = mirror_adapter(self.name, self.spec, state, self.engine.module_order,
                                           self.engine.peft_targets(self.name))
            self._optimizer = JobOptimizer(self.spec, self._adapter.parameters(), self.total_steps,
                                           fast_parameters=self._adapter.parameter_groups()[1])
        adapter, optimizer = self._adapter, self._optimizer
        assert optimizer is not None
        named = dict(adapter.named_parameters())
        with torch.no_grad():
            for key, parameter in named.items():
                parameter.copy_(state["tensors"][key])
                parameter.grad = None
        optimizer.optimizer.state.clear()
        for key, moments in state["moments"].items():
            optimizer.optimizer.state[named[key]] = {k: v.clone() for k, v in moments.items()}
        optimizer.group_lists.clear()   # the moments are new tensors now
        optimizer.step_count, optimizer.micro_count = state["step_count"], state["micro_count"]
        optimizer.set_lr()
        if adapter.dropout_generator is not None and state.get("dropout_generator") is not None:
            adapter.dropout_generator.set_state(state["dropout_generator"])
        self.stale = False

    def mirror_state(self) -> dict[str, Any]:
        """The mirror as the stages take a job's state (`JobSetup.state`): after a checkpoint was loaded into it."""
        adapter, optimizer = self.adapter, self.optimizer
        named = dict(adapter.named_parameters())
        tensors = {key: p.detach().clone() for key, p in named.items()}
        for module, a0, b0 in adapter.frozen_initial():
            tensors[f"{module}.lora_A0"], tensors[f"{module}.lora_B0"] = a0.clone(), b0.clone()
        by_id = {id(p): key for key, p in named.items()}
        moments = {by_id[id(p)]: {k: v.clone() for k, v in entry.items()}
                   for p, entry in optimizer.optimizer.state.items()}
        gradients = {key: p.grad.clone() for key, p in named.items() if p.grad is not None}
        generator = adapter.dropout_generator
        return {"tensors": tensors, "moments": moments, "gradients": gradients,
                "step_count": optimizer.step_count, "micro_count": optimizer.micro_count,
                "dropout_generator": generator.get_state().clone() if generator is not None else None,
                "data_position": self.head.cursor.state_dict(), "history": [vars(r) for r in self.history],
                "tokens_seen": self.tokens_seen,
                "accumulator": self.accumulator if self.accumulator.micro_batches else None}
