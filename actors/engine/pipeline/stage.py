"""One pipeline stage at work: its share of every job's adapter and optimizer, and the operations the
schedule gives it (actors/engine/pipeline/pipeline_schedule.py), run in that order.

Every stage gets the same stream of messages from the head (plans, jobs coming and going:
actors/engine/pipeline/stage_messages.py) and feeds them to its own copy of the schedule, so all stages agree
on the global order of operations; each then runs its own, each kind of operation (`OpKind`) by its own
handler. A forward packs the plan's micro-batches itself (as a single-device step does), takes the previous
stage's hidden states (stage 0: the token ids), runs its layers with each job's tokens through its own
adapter, and sends its output on; the last stage computes the step's objective (actors/engine/
step_objective.py) and backpropagates at once; a backward takes the gradient of its output and sends its
input's gradient back. A job's gradients thus accumulate at each stage in the order of its micro-batches.

When a micro-batch closes a job's accumulation, the stages chain the job's gradient norm from the last stage
to stage 0 (actors/engine/pipeline/stage_norms.py), which sends the total to every stage, and each steps its
share of the job (clip by the total, fused AdamW) before the job's next forward there. A job with adapter
dropout passes its generator's state along with its activations (and back from the last stage to stage 0
with the results), so the masks are drawn from one sequence, as on one device. DPO and GRPO references and
evaluations, without gradients: actors/engine/pipeline/stage_evaluation.py; its busy time and memory:
actors/engine/pipeline/stage_measures.py."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from actors.engine.adapter_surgery import remove_adapter, set_adapters_training
from actors.engine.joint_steps import apply_step
from actors.engine.layout import step_layout
from actors.engine.packing import FusedBatch, pack
from actors.engine.pipeline.pipeline_schedule import Op, OpKind, PipelineSchedule
from actors.engine.pipeline.stage_evaluation import StageEvaluator
from actors.engine.pipeline.stage_generation import GenerateRequest, HeldAdapter
from actors.engine.pipeline.stage_jobs import StageJob, merge_job_states
from actors.engine.pipeline.stage_measures import StageMeasures
from actors.engine.pipeline.stage_memory import StageMemory
from actors.engine.pipeline.stage_messages import EvalRequest, JobSetup, PlanMessage, StageMessageKind, StageSettings
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.stage_norms import GradientNormChain
from actors.engine.pipeline.transport import (
    TAG_ACTIVATION,
    TAG_GENERATOR,
    TAG_GRADIENT,
    TAG_REPLY,
    TAG_RESULT,
    StageLinks,
)
from actors.engine.recompute import recomputed_layers
from actors.engine.step_objective import ObjectiveJob, step_objective

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Flight:
    batch: FusedBatch
    input: torch.Tensor | None
    output: torch.Tensor


class StageRuntime:
    """One stage's operations over its share of the jobs; `handle` runs each message of the head. Each message kind
    and operation kind is run by the method its table names (`MESSAGES`, `OPERATIONS`)."""

    MESSAGES = {StageMessageKind.PLAN: "_take_plan", StageMessageKind.ADD_JOB: "_add_job",
                StageMessageKind.REMOVE_JOB: "_remove_job", StageMessageKind.READ_JOB: "_read_job",
                StageMessageKind.DRAIN: "_drain", StageMessageKind.STATS: "stats", StageMessageKind.MEMORY: "memory",
                StageMessageKind.MEASURE: "_measure", StageMessageKind.EVALUATE: "_evaluate",
                StageMessageKind.GENERATE: "_generate", StageMessageKind.HOLD: "_hold"}
    OPERATIONS = {OpKind.FORWARD: "_forward_op", OpKind.FORWARD_BACKWARD: "_forward_backward_op",
                  OpKind.BACKWARD: "_backward_op", OpKind.OPTIMIZER_STEP: "_optimizer_step_op",
                  OpKind.TAKE_RESULTS: "_take_results_op", OpKind.REMOVE_JOB: "_remove_job_op",
                  OpKind.READ_JOB: "_read_job_op"}

    def __init__(self, model: StageModel, links: StageLinks, settings: StageSettings):
        self.model = model
        self.links = links
        self.settings = settings
        self.schedule = PipelineSchedule(self.stages, backward_ratio=settings.backward_ratio, flush=settings.flush)
        self.jobs: dict[str, StageJob] = {}
        self.plans: dict[int, PlanMessage] = {}
        self.flight: dict[int, _Flight] = {}
        self.norms = GradientNormChain(model, links)
        self.evaluator = StageEvaluator(model, links, settings, self.jobs)
        self.results_received = -1
        self.on_result = None          # stage 0: the head's callback for each result
        self.measures = StageMeasures(model, links, settings, self.jobs)   # busy time, memory model and window

    @property
    def stage(self) -> int:
        return self.model.stage

    @property
    def stages(self) -> int:
        return self.model.stages

    # -- messages ----------------------------------------------------------------------------------
    def handle(self, message: tuple) -> Any:
        """Run a head's message `(kind, *arguments)`: the stage's answer to one that asks (stats, memory,
        measure, eval), else the replies of the operations it let run (a job's state read, at stage 0)."""
        kind, *arguments = message
        name = self.MESSAGES.get(kind)
        if name is None:
            raise ValueError(f"unknown pipeline message {kind!r}: one of {', '.join(map(str, StageMessageKind))} "
                             "(stop ends a stage process before it reaches the stage)")
        return getattr(self, name)(*arguments)

    def _take_plan(self, message: PlanMessage) -> list[dict] | None:
        self.plans[message.plan.index] = message
        self.norms.expect(message.plan)
        self.schedule.add_plan(message.plan)
        return self.run_ops()

    def _add_job(self, setup: JobSetup) -> list[dict] | None:
        if setup.spec.name in self.jobs:
            raise ValueError(f"job '{setup.spec.name}' is already on this pipeline")
        self.jobs[setup.spec.name] = StageJob.set_up(self.model, setup)
        return self.run_ops()

    def _remove_job(self, job: str) -> list[dict] | None:
        self.schedule.remove_job(job)
        return self.run_ops()

    def _read_job(self, job: str) -> list[dict] | None:
        self.schedule.read_job(job)
        return self.run_ops()

    def _drain(self) -> list[dict] | None:
        self.schedule.drain()
        return self.run_ops()

    def stats(self) -> dict[str, float]:
        return self.measures.stats()

    def held_bytes(self) -> int:
        return self.measures.held_bytes()

    def memory(self) -> StageMemory:
        return self.measures.memory()

    def _measure(self, on: bool) -> int | None:
        return self.measures.measure(on)

    def _evaluate(self, request: EvalRequest) -> float | None:
        return self.evaluator.evaluate(request)

    def _generate(self, request: GenerateRequest) -> None:
        """A stage but 0 serves a decoding call's steps (stage 0 leads it: the head's `generate`)."""
        self.evaluator.generation.serve(request)

    def _hold(self, request: HeldAdapter) -> dict | None:
        """An adapter held for decoding calls only (stage_generation.py: "try it" on a finished job)."""
        return self.evaluator.generation.hold(request)

    def close(self, *, flush: bool = True) -> None:
        """Leave the pipeline in order, nothing native left to the garbage collector: the sends waited for, a
        memory window left open closed (its profiler off), then the process group destroyed (`links.close`).
        `flush=False` after a failure (a peer may never take what is pending)."""
        if flush:
            self.links.flush()
        self.measures.window.close()
        self.links.close(flush=flush)

    # -- operations --------------------------------------------------------------------------------
    def run_ops(self) -> list[dict] | None:
        replies = None
        for op in self.schedule.take(self.stage):
            name = self.OPERATIONS.get(op.kind)
            if name is None:
                raise ValueError(f"pipeline stage {self.stage}: no handler for operation kind {op.kind!r} "
                                 f"(the kinds: {', '.join(map(repr, OpKind))})")
            started = time.perf_counter()
            waited = self.links.waited
            reply = getattr(self, name)(op)
            if reply is not None:
                replies = (replies or []) + [reply]
            self.measures.time.record(op, started, time.perf_counter(), self.links.waited - waited)
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

    def _forward_op(self, op: Op) -> None:
        """A micro-batch's forward here (DPO and GRPO references first), its output sent to the next stage."""
        self.evaluator.plan_references(self.plans[op.index])
        batch = self._batch(op.index)
        hidden = self._receive_input(op, batch)
        output = self._forward(batch, hidden)
        self.links.send(output.detach(), self.stage + 1, TAG_ACTIVATION)
        for job in self.plans[op.index].plan.serial:
            self.links.send_state(self._generator(job).get_state(), self.stage + 1, TAG_GENERATOR)
        self.flight[op.index] = _Flight(batch=batch, input=hidden, output=output)

    def _forward_backward_op(self, op: Op) -> None:
        """The last stage: a micro-batch's forward, the step's objective and its backward at once; the results
        to stage 0, the input's gradient to the stage before."""
        message = self.plans[op.index]
        references = self.evaluator.plan_references(message)
        batch = self._batch(op.index)
        hidden = self._receive_input(op, batch)
        output = self._forward(batch, hidden)
        states = {job: self._generator(job).get_state().clone() for job in message.plan.serial}
        olds = {index: old.to(output.device) for index, old in message.olds.items()}
        objective = step_objective(self.model.base, batch, output,
                                   [ObjectiveJob(spec=self.jobs[mb.job].spec) for mb in message.micro_batches],
                                   list(message.micro_batches), references, self.settings.loss_chunk, olds)
        objective.total.backward()
        if hidden is not None:
            self.links.send(hidden.grad, self.stage - 1, TAG_GRADIENT)
        result = {"index": op.index, "jobs": list(batch.jobs), "losses": objective.losses,
                  "counts": objective.counts, "metrics": objective.metrics, "tokens": list(batch.job_tokens),
                  "targets": list(batch.job_targets), "generators": states, "padding": batch.padding_tokens,
                  "stream": batch.num_tokens, "generations": self._generations(message, objective.completion_logps)}
        if self.stages == 1:
            self._take_result(result)
        else:
            self.links.send_object(result, 0, TAG_RESULT)
        self.norms.add_share(message, self.jobs)
        del self.plans[op.index]

    def _generations(self, message: PlanMessage, logps: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The completion tokens' log-probabilities of the plan's GRPO generation micro-batches that will be
        replayed (num_iterations > 1), for the head to keep (`HeadJob.generation_booked`): CPU, float32."""
        out = {}
        for index, micro_batch in enumerate(message.micro_batches):
            grpo = self.jobs[micro_batch.job].spec.grpo
            if grpo is not None and grpo.num_iterations > 1 and index not in message.olds:
                out[index] = logps[index].detach().to("cpu", torch.float32)
        return out

    def _backward_op(self, op: Op) -> None:
        """A micro-batch's backward here from its output's gradient; its input's gradient sent back."""
        flight = self.flight.pop(op.index)
        gradient = self.links.recv(tuple(flight.output.shape), flight.output.dtype, self.stage + 1, TAG_GRADIENT)
        torch.autograd.backward(flight.output, gradient)
        if flight.input is not None:
            self.links.send(flight.input.grad, self.stage - 1, TAG_GRADIENT)
        self.norms.add_share(self.plans.pop(op.index), self.jobs)

    def _optimizer_step_op(self, op: Op) -> None:
        """The job's step on its share here, clipped by its total gradient norm over every stage."""
        total = self.norms.total(op.job, op.index)
        job = self.jobs[op.job]
        if job.optimizer is not None:
            apply_step([job.optimizer], [total])

    def _take_results_op(self, op: Op) -> None:
        """Stage 0: the last stage's results of the micro-batches up to `op.index`."""
        while self.results_received < op.index:
            self._take_result(self.links.recv_object(self.stages - 1, TAG_RESULT))

    def _take_result(self, result: dict) -> None:
        self.results_received = result["index"]
        for job, state in result["generators"].items():
            if self.stages > 1 and job in self.jobs:
                self._generator(job).set_state(state)
        if self.on_result is not None:
            self.on_result(result)

    def _remove_job_op(self, op: Op) -> None:
        job = self.jobs.pop(op.job)
        self.evaluator.forget(op.job)
        remove_adapter(self.model.base.model, op.job)
        if job.reference is not None:
            remove_adapter(self.model.base.model, job.reference.name)

    def _read_job_op(self, op: Op) -> dict | None:
        """The job's state: each stage's share sent to stage 0, which answers the whole."""
        state = self.jobs[op.job].state()
        if self.stage > 0:
            self.links.send_object(state, 0, TAG_REPLY)
            return None
        shares = [state] + [self.links.recv_object(stage, TAG_REPLY) for stage in range(1, self.stages)]
        return {"job": op.job, "state": merge_job_states(shares)}
