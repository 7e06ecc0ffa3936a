"""`compile: graphs` on one device's fused trainer (actors/engine/trainer.py): which of its steps take a fixed shape
(actors/engine/fixed_shapes.py), their run as a captured CUDA graph (actors/engine/step_graphs.py: captured once
per shape, then replayed), the next step's fixed batch made while this one runs, and the memory the graphs hold.
A step that cannot take a graph (`step_graphs.refusal`, or an adapter whose weights are not pooled) runs eagerly,
the reason logged once."""

from __future__ import annotations

import logging

import torch

from actors.data import Example
from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.fixed_shapes import FixedShape
from actors.engine.interactive_step import FusedCalls
from actors.engine.job import TrainingJob
from actors.engine.layout import StepLayout, step_layout
from actors.engine.lora_masters import pool_of
from actors.engine.memory import StepMemoryMeter
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch, JobMicroBatch, pack
from actors.engine.step_batches import batch_key
from actors.engine.step_graphs import GraphBackend, StepGraphs, refusal
from actors.engine.step_objective import StepObjective, fixed_objective
from actors.spec.base_settings import Layout, Recompute

log = logging.getLogger(__name__)


class GraphedSteps:
    """A trainer's captured steps (`graphs`) over its `base`, with its `layout`, `recompute` and loss chunk;
    `backend`: how graphs are captured (CUDA graphs when None: the base must be on a GPU; a stand-in on the CPU's
    tests)."""

    def __init__(self, base: BaseModel, *, layout: Layout, recompute: Recompute, loss_chunk: int,
                 backend: GraphBackend | None):
        if backend is None and base.device.type != "cuda":
            raise ValueError(f"compile: graphs captures steps as CUDA graphs: this base is on {base.device}; "
                             "set compile: none (or default) off a GPU")
        self.base, self.layout, self.recompute = base, layout, recompute

        def forward(layout: StepLayout, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            with step_layout(layout):
                return base.decoder(input_ids=input_ids[None], position_ids=position_ids[None],
                                    attention_mask=None, use_cache=False).last_hidden_state[0]

        def objective(hidden: torch.Tensor, parts: dict[str, torch.Tensor]) -> StepObjective:
            return fixed_objective(base, hidden, parts["target_ids"], parts["target_job"], parts["job_targets"],
                                   loss_chunk)

        self.graphs = StepGraphs(base.device, base.pad_token_id, forward, objective, backend=backend)

    def shape(self, jobs: list[TrainingJob], micro_batches: list[JobMicroBatch]) -> FixedShape | None:
        """The fixed shape a step of these micro-batches (of `jobs`, in order) would take, where their jobs can take
        one; else None."""
        if refusal(jobs, dtype=self.base.dtype, layout=self.layout, recompute=self.recompute, calls=False):
            return None
        return self.graphs.planned(tuple(mb.job for mb in micro_batches), [mb.num_tokens for mb in micro_batches],
                                   [len(mb.rows) for mb in micro_batches], ceilings(jobs))

    def held_bytes(self, shape: FixedShape | None) -> int:
        """Device memory the captured steps' pools hold beside a step of `shape` (one that replays runs in its own)."""
        return self.graphs.held_bytes(shape)

    def run(self, chosen: list[tuple[TrainingJob, list[Example]]], micro_batches: list[JobMicroBatch],
            calls: FusedCalls | None, meter: StepMemoryMeter) -> tuple | None:
        """The step's forward, loss and backward as a graph, where it can take one: (the packed host batch, the
        objective, the step's tokens and padding in its fixed shape, the loss's rows, whether it was a replay); else
        None (the reason logged once per reason)."""
        jobs = [job for job, _ in chosen]
        reason = refusal(jobs, dtype=self.base.dtype, layout=self.layout, recompute=self.recompute, calls=bool(calls))
        pools = [pool_of(job.optimizer.parameters) for job in jobs]
        if reason is None and any(pool is None for pool in pools):
            reason = "an adapter whose weights are not pooled (not the CUDA LoRA path's plain LoRA)"
        if reason is not None:
            if reason not in self.graphs.refusals:
                self.graphs.refusals.add(reason)
                log.info("compile: graphs: a step runs eagerly: %s", reason)
            return None
        fixed = self.graphs.take_ahead(batch_key(micro_batches))   # packed during the step before, where it was
        if fixed is None:
            fixed = self.graphs.fixed(self._pack(micro_batches), ceilings(jobs))
        set_adapters_training(self.base.model, True)
        with meter.forward():
            replays = self.graphs.replays
            objective = self.graphs.run(fixed, pools)
        packed = fixed.packed
        objective = StepObjective(objective.total, objective.job_losses, list(packed.job_targets), [None] * len(jobs))
        tokens = fixed.shape.tokens
        return packed, objective, tokens, tokens - packed.num_tokens, tokens, self.graphs.replays > replays

    def send_ahead(self, jobs: list[TrainingJob], micro_batches: list[JobMicroBatch]) -> None:
        """The next step's fixed batch made on the host now, while this step's kernels run, where it takes a graph
        (its copy into the graph's inputs waits for the step: they are the graph's)."""
        if self.shape(jobs, micro_batches) is not None:
            self.graphs.send_ahead(batch_key(micro_batches), self._pack(micro_batches), ceilings(jobs))

    def _pack(self, micro_batches: list[JobMicroBatch]) -> FusedBatch:
        return pack(micro_batches, "packed", self.base.pad_token_id)


def ceilings(jobs: list[TrainingJob]) -> tuple[tuple[int, int], ...]:
    """The most tokens and rows each (sft) job's micro-batch holds: its fixed segment's bound."""
    return tuple((job.spec.batch_size * job.spec.max_seq_len, job.spec.batch_size) for job in jobs)
