"""What a pipeline stage measures of itself: its busy time over its operations (and so its bubble), what it holds
between steps, its memory model (its activations probed once), and the allocator's window over a step's
operations, which the trainer's memory admission reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine import lora_cuda
from actors.engine.memory import optimizer_state_bytes
from actors.engine.memory_profile import MemoryWindow
from actors.engine.pipeline.pipeline_schedule import COMPUTE_KINDS, Op, OpKind
from actors.engine.pipeline.stage_jobs import StageJob
from actors.engine.pipeline.stage_memory import StageActivation, StageMemory, probe_stage_activation
from actors.engine.pipeline.stage_messages import StageSettings
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.transport import StageLinks


@dataclass
class BusyTime:
    """A stage's seconds running operations (its waits for inputs excluded), from its first micro-batch
    operation to its last."""

    busy: float = 0.0
    first: float | None = None
    last: float = 0.0

    def record(self, op: Op, started: float, now: float, waited: float) -> None:
        if self.first is None and op.kind in COMPUTE_KINDS:
            self.first = started
        if op.kind in COMPUTE_KINDS or op.kind == OpKind.OPTIMIZER_STEP:
            self.busy += (now - started) - waited
            self.last = now

    @property
    def span(self) -> float:
        return (self.last - self.first) if self.first is not None else 0.0


class StageMeasures:
    """The stage's measures; `jobs` is the stage's own (their optimizers' state counts as held)."""

    def __init__(self, model: StageModel, links: StageLinks, settings: StageSettings, jobs: dict[str, StageJob]):
        self.model = model
        self.links = links
        self.settings = settings
        self.jobs = jobs
        self.time = BusyTime()
        self.activation: StageActivation | None = None   # probed on the first `memory` message
        self.window = MemoryWindow(model.base.device)

    def stats(self) -> dict[str, float]:
        """Busy time, span and bubble share (the span's idle share); the weights held and, on CUDA, the
        allocator's peak so far."""
        span = self.time.span
        device = self.model.base.device
        return {"stage": self.model.stage, "busy_s": self.time.busy, "span_s": span,
                "bubble_share": (1.0 - self.time.busy / span) if span > 0 else 0.0,
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
        return StageMemory(stage=self.model.stage, stages=self.model.stages, held=self.held_bytes(),
                           activation=self.activation, vocab=int(config.vocab_size), hidden=self.model.hidden_size,
                           dtype=base.dtype, loss_chunk=self.settings.loss_chunk,
                           compute_path=lora_cuda.applies(base.device, base.dtype))

    def measure(self, on: bool) -> int | None:
        """Open (`on`) or close the allocator's window over the operations in between; closing answers the
        peak bytes live meanwhile."""
        self.links.flush()   # no send queued outside the window runs inside it, nor one from inside after it
        if on:
            self.window.start(self.held_bytes())
            return None
        return self.window.stop()
