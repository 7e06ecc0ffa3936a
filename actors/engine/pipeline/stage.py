"""One pipeline stage at work: its share of every job's adapter and optimizer, and the operations the
schedule gives it (actors/engine/pipeline/pipeline_schedule.py), run in that order.

Every stage gets the same stream of messages from the head (plans, jobs coming and going) and feeds them to
its own copy of the schedule, so all stages agree on the global order of operations; each then runs its
own. A forward packs the plan's micro-batches itself (as a single-device step does), takes the previous
stage's hidden states (stage 0: the token ids), runs its layers with each job's tokens through its own
adapter, and sends its output on; the last stage computes the step's objective (actors/engine/
step_objective.py) and backpropagates at once; a backward takes the gradient of its output and sends its
input's gradient back. A job's gradients thus accumulate at each stage in the order of its micro-batches.

When a micro-batch closes a job's accumulation, each stage divides the job's gradients by its step's target
count and adds its tensors' squared norms to the partial sum the next stage passed back
(`optim.chained_sum`, last stage first), so stage 0 ends with the same float64 sum a single device computes;
it sends the total to every stage, and each steps its share of the job (clip by the total, fused AdamW)
before the job's next forward there. A job with adapter dropout passes its generator's state along with its
activations (and back from the last stage to stage 0 with the results), so the masks are drawn from one
sequence, as on one device."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from actors.engine import lora_cuda
from actors.engine.layout import step_layout
from actors.engine.lora import AdapterHandle, add_adapter, remove_adapter, set_adapters_training
from actors.engine.loss import target_cross_entropy
from actors.engine.memory import MemoryWindow, optimizer_state_bytes
from actors.engine.optim import JobOptimizer, apply_step, chained_sum, gradient_squares
from actors.engine.packing import FusedBatch, JobMicroBatch, pack
from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan, Op, PipelineSchedule
from actors.engine.pipeline.stage_memory import StageActivation, StageMemory, probe_stage_activation
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.transport import (
    TAG_ACTIVATION,
    TAG_GENERATOR,
    TAG_GRADIENT,
    TAG_PARTIAL,
    TAG_REPLY,
    TAG_RESULT,
    TAG_TOTAL,
    StageLinks,
)
from actors.engine.preference import ReferenceCache, evaluation_outcome, reference_layout, reference_sums
from actors.engine.recompute import recomputed_layers
from actors.engine.step_objective import ObjectiveJob, step_objective
from actors.spec.job_spec import JobSpec
from actors.spec.method_config import PREFERENCE_METHODS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSettings:
    layout: str = "packed"
    loss_chunk: int = 1024
    recompute: str = "none"
    backward_ratio: float = 2.0
    flush: bool = False       # a generic pipeline's flush at every step (bench/pipeline.py's comparison only)
    lora_grouping: str | None = None   # actors.engine.lora.GROUPING in every stage process (None: as it is)


@dataclass(frozen=True)
class PlanMessage:
    """A plan with what the stages need to run it: the jobs' micro-batches, and for each job it closes the
    number of targets (tokens, or a preference job's pairs) its optimizer step is the mean over."""

    plan: MicroBatchPlan
    micro_batches: tuple[JobMicroBatch, ...]
    step_targets: dict[str, int] = field(default_factory=dict)
    # DPO: the pairs whose reference log-probabilities the last stage lacks (`ReferenceCache.missing` of the
    # plan's DPO micro-batches), run through the stages with no adapter before the plan's forward
    references: tuple = ()


@dataclass(frozen=True)
class EvalRequest:
    """A job's evaluation: its eval batches (each with the DPO reference pairs to compute first, if any)."""

    job: str
    batches: tuple[tuple[JobMicroBatch, tuple], ...]


@dataclass(frozen=True)
class JobSetup:
    spec: JobSpec
    seed: int
    total_steps: int
    state: dict | None = None    # `job_state` of an earlier run: every stage takes its own tensors


@dataclass
class StageJob:
    spec: JobSpec
    adapter: AdapterHandle
    optimizer: JobOptimizer | None   # None where this stage holds none of the job's layers

    def state(self) -> dict[str, Any]:
        """This stage's share: adapter tensors and AdamW moments by parameter name, the step counters."""
        names = [name for name, _ in self.adapter.named_parameters()]
        tensors = {name: p.detach().cpu().clone() for name, p in self.adapter.named_parameters()}
        for name, a0, b0 in self.adapter.frozen_initial():
            tensors[f"{name}.lora_A0"], tensors[f"{name}.lora_B0"] = a0.cpu().clone(), b0.cpu().clone()
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
        with torch.no_grad():
            for name, parameter in named.items():
                parameter.copy_(state["tensors"][name])
                gradient = state.get("gradients", {}).get(name)   # resumed mid-accumulation
                parameter.grad = None if gradient is None else gradient.to(parameter.device, parameter.dtype)
            for name, a0, b0 in self.adapter.frozen_initial():
                a0.copy_(state["tensors"][f"{name}.lora_A0"])
                b0.copy_(state["tensors"][f"{name}.lora_B0"])
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


@dataclass
class _Flight:
    batch: FusedBatch
    input: torch.Tensor | None
    output: torch.Tensor


class StageRuntime:
    def __init__(self, model: StageModel, links: StageLinks, settings: StageSettings):
        self.model = model
        self.links = links
        self.settings = settings
        self.stage, self.stages = model.stage, model.stages
        self.schedule = PipelineSchedule(self.stages, backward_ratio=settings.backward_ratio, flush=settings.flush)
        self.jobs: dict[str, StageJob] = {}
        self.plans: dict[int, PlanMessage] = {}
        self.flight: dict[int, _Flight] = {}
        self.norms: dict[tuple[str, int], float] = {}      # stage 0: each closing step's total norm (the head's)
        self.step_norms: dict[tuple[str, int], float] = {}   # stage 0: the same, until its own step takes it
        self.totals_order: deque[tuple[str, int]] = deque()   # the order stage 0 sends totals in
        self.totals: dict[tuple[str, int], float] = {}
        self.results_received = -1
        self.reference_caches: dict[str, ReferenceCache] = {}   # the last stage's DPO references, by job
        self.on_result = None          # stage 0: the head's callback for each result
        self.activation: StageActivation | None = None   # probed on the first `memory` message
        self.window = MemoryWindow(model.base.device)
        self.busy = 0.0                # seconds running operations, waits excluded
        self.first_op: float | None = None
        self.last_op = 0.0

    # -- messages ----------------------------------------------------------------------------------
    def handle(self, message: tuple) -> Any:
        kind = message[0]
        if kind == "plan":
            plan_message: PlanMessage = message[1]
            self.plans[plan_message.plan.index] = plan_message
            self.totals_order.extend((job, plan_message.plan.index) for job in plan_message.plan.closes)
            self.schedule.add_plan(plan_message.plan)
        elif kind == "add":
            self._add(message[1])
        elif kind == "remove":
            self.schedule.remove_job(message[1])
        elif kind == "read":
            self.schedule.read_job(message[1])
        elif kind == "drain":
            self.schedule.drain()
        elif kind == "stats":
            return self.stats()
        elif kind == "memory":
            return self.memory()
        elif kind == "measure":
            return self._measure(message[1])
        elif kind == "eval":
            return self._evaluate(message[1])
        else:
            raise ValueError(f"unknown pipeline message {kind!r}")
        return self.run_ops()

    def stats(self) -> dict[str, float]:
        """Busy time, span and bubble share (the span's idle share); the weights held and, on CUDA, the
        allocator's peak so far."""
        span = (self.last_op - self.first_op) if self.first_op is not None else 0.0
        device = self.model.base.device
        return {"stage": self.stage, "busy_s": self.busy, "span_s": span,
                "bubble_share": (1.0 - self.busy / span) if span > 0 else 0.0,
                "weight_bytes": self.model.held_bytes(),
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}

    def held_bytes(self) -> int:
        """What this stage holds between steps: its weights and adapters, AdamW moments, gradients."""
        gradients = sum(p.grad.numel() * p.grad.element_size() for p in self.model.base.model.parameters()
                        if p.grad is not None)
        optimizers = sum(optimizer_state_bytes(job.optimizer.optimizer) for job in self.jobs.values()
                         if job.optimizer is not None)
        return self.model.held_bytes() + optimizers + gradients

    def memory(self) -> StageMemory:
        """This stage's memory model (its activations probed once, on first asking)."""
        if self.activation is None:
            self.activation = probe_stage_activation(self.model, recompute=self.settings.recompute)
        config = self.model.base.model.config
        base = self.model.base
        return StageMemory(self.stage, self.stages, self.held_bytes(), self.activation, int(config.vocab_size),
                           self.model.hidden_size, base.dtype, self.settings.loss_chunk,
                           compute_path=lora_cuda.applies(base.device, base.dtype))

    def _measure(self, on: bool) -> int | None:
        """Open (`on`) or close the allocator's window over the operations in between; closing answers the
        peak bytes live meanwhile."""
        self.links.flush()   # no send queued outside the window runs inside it, nor one from inside after it
        if on:
            self.window.start(self.held_bytes())
            return None
        return self.window.stop()

    def close(self, *, flush: bool = True) -> None:
        """Leave the pipeline in order, nothing native left to the garbage collector: the sends waited for, a
        memory window left open closed (its profiler off), then the process group destroyed (`links.close`).
        `flush=False` after a failure (a peer may never take what is pending)."""
        if flush:
            self.links.flush()
        self.window.close()
        self.links.close(flush=flush)

    def _add(self, setup: JobSetup) -> None:
        name = setup.spec.name
        if name in self.jobs:
            raise ValueError(f"job '{name}' is already on this pipeline")
        base = self.model.base
        adapter = add_adapter(base.model, name, setup.spec.lora, seed=setup.seed)
        parameters = adapter.parameters()
        optimizer = (JobOptimizer(setup.spec, parameters, setup.total_steps,
                                  fast_parameters=adapter.parameter_groups()[1]) if parameters else None)
        job = StageJob(setup.spec, adapter, optimizer)
        if setup.state is not None:
            job.load(setup.state)
        self.jobs[name] = job

    # -- operations --------------------------------------------------------------------------------
    def run_ops(self) -> list[dict] | None:
        replies = None
        for op in self.schedule.take(self.stage):
            started = time.perf_counter()
            waited = self.links.waited
            if self.first_op is None and op.kind in ("F", "FB", "B"):
                self.first_op = started
            reply = getattr(self, f"_op_{op.kind}")(op)
            if reply is not None:
                replies = (replies or []) + [reply]
            now = time.perf_counter()
            if op.kind in ("F", "FB", "B", "O"):
                self.busy += (now - started) - (self.links.waited - waited)
                self.last_op = now
        return replies

    def _batch(self, index: int) -> FusedBatch:
        message = self.plans[index]
        base = self.model.base
        return pack(list(message.micro_batches), self.settings.layout, base.pad_token_id).to(base.device)

    def _generator(self, job: str) -> torch.Generator:
        return self.jobs[job].adapter.dropout_generator

    def _forward(self, batch: FusedBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        set_adapters_training(self.model.base.model, True)
        with step_layout(batch.layout), recomputed_layers(self.model.view, self.settings.recompute):
            return self.model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)

    def _receive_input(self, op: Op, batch: FusedBatch) -> torch.Tensor | None:
        if self.model.first:
            return None
        base = self.model.base
        hidden = self.links.recv((batch.num_tokens, self.model.hidden_size), base.dtype, self.stage - 1,
                                 TAG_ACTIVATION)
        for job in self.plans[op.index].plan.serial:
            generator = self._generator(job)
            generator.set_state(self.links.recv_state(generator.get_state().numel(), self.stage - 1, TAG_GENERATOR))
        return hidden.requires_grad_(True)

    def _reference_forward(self, micro_batches: list[JobMicroBatch]) -> list[torch.Tensor] | None:
        """The base alone (no adapter) over these pairs, through this stage; the last stage returns their
        reference log-probabilities (`preference.reference_sums`)."""
        base = self.model.base
        batch = pack(micro_batches, "packed", base.pad_token_id).to(base.device)
        hidden = None
        if not self.model.first:
            hidden = self.links.recv((batch.num_tokens, self.model.hidden_size), base.dtype, self.stage - 1,
                                     TAG_ACTIVATION)
        with torch.no_grad(), step_layout(reference_layout(batch)):
            output = self.model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)
        if not self.model.last:
            self.links.send(output, self.stage + 1, TAG_ACTIVATION)
            return None
        return reference_sums(base, batch, micro_batches, output, self.settings.loss_chunk)

    def _references(self, micro_batches: list[JobMicroBatch], todo: tuple) -> dict[int, torch.Tensor]:
        """The DPO micro-batches' reference log-probabilities by their index among `micro_batches`: the pairs
        in `todo` computed through the stages (every stage takes part), the others from the last stage's
        caches, as `ReferenceCache.lookup` on one device."""
        computed = self._reference_forward([mb for _, _, mb in todo]) if todo else []
        if not self.model.last:
            return {}
        dpo = [index for index, mb in enumerate(micro_batches) if self.jobs[mb.job].spec.method == "dpo"]
        caches = [self.reference_caches.setdefault(micro_batches[index].job, ReferenceCache()) for index in dpo]
        keys, missing = ReferenceCache.missing([micro_batches[index] for index in dpo], caches)
        if [(i, k) for i, k, _ in missing] != [(i, k) for i, k, _ in todo]:
            raise RuntimeError("pipeline: the head's and the last stage's DPO reference caches disagree")
        fresh = ReferenceCache.store(missing, computed, caches)
        return dict(zip(dpo, ReferenceCache.assemble(keys, caches, fresh, self.model.base.device), strict=True))

    def _op_F(self, op: Op) -> None:
        self._references(list(self.plans[op.index].micro_batches), self.plans[op.index].references)
        batch = self._batch(op.index)
        hidden = self._receive_input(op, batch)
        output = self._forward(batch, hidden)
        self.links.send(output.detach(), self.stage + 1, TAG_ACTIVATION)
        for job in self.plans[op.index].plan.serial:
            self.links.send_state(self._generator(job).get_state(), self.stage + 1, TAG_GENERATOR)
        self.flight[op.index] = _Flight(batch, hidden, output)

    def _op_FB(self, op: Op) -> None:
        message = self.plans[op.index]
        references = self._references(list(message.micro_batches), message.references)
        batch = self._batch(op.index)
        hidden = self._receive_input(op, batch)
        output = self._forward(batch, hidden)
        states = {job: self._generator(job).get_state().clone() for job in message.plan.serial}
        objective = step_objective(self.model.base, batch, output,
                                   [ObjectiveJob(self.jobs[mb.job].spec) for mb in message.micro_batches],
                                   list(message.micro_batches), references, self.settings.loss_chunk)
        objective.total.backward()
        if hidden is not None:
            self.links.send(hidden.grad, self.stage - 1, TAG_GRADIENT)
        result = {"index": op.index, "jobs": list(batch.jobs), "losses": objective.losses,
                  "counts": objective.counts, "metrics": objective.metrics, "tokens": list(batch.job_tokens),
                  "targets": list(batch.job_targets), "generators": states, "padding": batch.padding_tokens,
                  "stream": batch.num_tokens}
        if self.stages == 1:
            self._take_result(result)
        else:
            self.links.send_object(result, 0, TAG_RESULT)
        self._partials(message)
        del self.plans[op.index]

    def _op_B(self, op: Op) -> None:
        flight = self.flight.pop(op.index)
        gradient = self.links.recv(tuple(flight.output.shape), flight.output.dtype, self.stage + 1, TAG_GRADIENT)
        torch.autograd.backward(flight.output, gradient)
        if flight.input is not None:
            self.links.send(flight.input.grad, self.stage - 1, TAG_GRADIENT)
        self._partials(self.plans.pop(op.index))

    def _partials(self, message: PlanMessage) -> None:
        """The closing jobs' gradient norms: this stage's share added to the partial sum from the next."""
        for name in message.plan.closes:
            job = self.jobs[name]
            squares = gradient_squares([job.optimizer], [message.step_targets[name]])[0] if job.optimizer else []
            start = self.links.recv_float(self.stage + 1, TAG_PARTIAL) if not self.model.last else 0.0
            partial = chained_sum(squares, start)
            if self.stage > 0:
                self.links.send_float(partial, self.stage - 1, TAG_PARTIAL)
                continue
            total = math.sqrt(partial)
            self.norms[(name, message.plan.index)] = self.step_norms[(name, message.plan.index)] = total
            for stage in range(1, self.stages):
                self.links.send_float(total, stage, TAG_TOTAL)

    def _total(self, job: str, index: int) -> float:
        if self.stage == 0:
            return self.step_norms.pop((job, index))
        while (job, index) not in self.totals:
            self.totals[self.totals_order.popleft()] = self.links.recv_float(0, TAG_TOTAL)
        return self.totals.pop((job, index))

    def _op_O(self, op: Op) -> None:
        total = self._total(op.job, op.index)
        job = self.jobs[op.job]
        if job.optimizer is not None:
            apply_step([job.optimizer], [total])

    def _op_R(self, op: Op) -> None:
        while self.results_received < op.index:
            self._take_result(self.links.recv_object(self.stages - 1, TAG_RESULT))

    def _take_result(self, result: dict) -> None:
        self.results_received = result["index"]
        for job, state in result["generators"].items():
            if self.stages > 1 and job in self.jobs:
                self._generator(job).set_state(state)
        if self.on_result is not None:
            self.on_result(result)

    def _evaluate(self, request: EvalRequest) -> float | None:
        """A job's eval loss, as `FusedTrainer.evaluate` computes it, every stage taking part (the pipeline
        drained first by the head); stage 0 returns it."""
        base = self.model.base
        spec = self.jobs[request.job].spec
        loss_sum, count = 0.0, 0
        set_adapters_training(base.model, False)
        try:
            with torch.no_grad():
                for micro_batch, todo in request.batches:
                    references = self._references([micro_batch], todo) if spec.method == "dpo" else {}
                    batch = pack([micro_batch], "packed", base.pad_token_id).to(base.device)
                    hidden = None
                    if not self.model.first:
                        hidden = self.links.recv((batch.num_tokens, self.model.hidden_size), base.dtype,
                                                 self.stage - 1, TAG_ACTIVATION)
                    with step_layout(batch.layout):
                        output = self.model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids,
                                                    hidden=hidden)
                    if not self.model.last:
                        self.links.send(output, self.stage + 1, TAG_ACTIVATION)
                        continue
                    if spec.method in PREFERENCE_METHODS:
                        outcome = evaluation_outcome(base, spec.method, spec.preference.beta, batch, micro_batch,
                                                     output, self.settings.loss_chunk, references.get(0),
                                                     spec.preference.cpo_alpha)
                        loss_sum += outcome.loss * outcome.pairs
                        count += outcome.pairs
                        continue
                    head = base.lm_head
                    weights = torch.ones(batch.target_ids.numel(), device=output.device)
                    total, _ = target_cross_entropy(output[batch.target_index], head.weight, head.bias,
                                                    batch.target_ids, weights, self.settings.loss_chunk,
                                                    base.logit_transform)
                    loss_sum += float(total)
                    count += int(batch.target_ids.numel())
        finally:
            set_adapters_training(base.model, True)
        if self.model.last:
            value = loss_sum / max(count, 1)
            if self.stages == 1:
                return value
            self.links.send_object(value, 0, TAG_REPLY)
            return None
        return self.links.recv_object(self.stages - 1, TAG_REPLY) if self.model.first else None

    def _op_X(self, op: Op) -> None:
        self.jobs.pop(op.job)
        self.reference_caches.pop(op.job, None)
        remove_adapter(self.model.base.model, op.job)

    def _op_Q(self, op: Op) -> dict | None:
        state = self.jobs[op.job].state()
        if self.stage > 0:
            self.links.send_object(state, 0, TAG_REPLY)
            return None
        shares = [state] + [self.links.recv_object(stage, TAG_REPLY) for stage in range(1, self.stages)]
        # stage 0's dropout generator is the job's current one: the last stage's state came back with the
        # results of the job's last micro-batch (taken before this operation)
        merged: dict[str, Any] = {"tensors": {}, "moments": {}, "step_count": shares[0]["step_count"],
                                  "micro_count": shares[0]["micro_count"],
                                  "dropout_generator": shares[0]["dropout_generator"]}
        for share in shares:
            merged["tensors"].update(share["tensors"])
            merged["moments"].update(share["moments"])
            if share["step_count"] or share["micro_count"]:
                merged["step_count"], merged["micro_count"] = share["step_count"], share["micro_count"]
        return {"job": op.job, "state": merged}
