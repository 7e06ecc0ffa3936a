"""What a pipeline stage needs in memory: its activations per token MEASURED on its own layers (as the
single-device prior measures the whole base's, actors/engine/memory_prior.py), and its peak predicted for
the micro-batches a loop step sends through it.

A stage holds its weights, its share of every job's adapter, AdamW moments and gradients (`held`, counted
live), and the activations of the micro-batches it has forwarded and not yet backwarded: at most S - s of
them at stage s (1F1B's bound, actors/engine/pipeline/pipeline_schedule.py), the last of them at its backward's peak. So

    peak_s(T) = held_s + (S - s - 1) * saved_s(T) + step_s(T)   (+ the loss's bytes at the last stage)

where T is a micro-batch's tokens, saved_s(T) what a forward leaves live for its backward and step_s(T) a
forward-and-backward's peak over what was live before; both straight lines in T through two probe
micro-batches of a rank-1 adapter on every linear layer, their allocations counted by the allocator
(`memory.measure_allocations`: CUDA's counters, torch.profiler's memory records on CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.data import Example
from actors.engine import lora_cuda
from actors.engine.adapter_activations import (
    AdapterTerms,
    adapter_bytes,
    adapter_terms,
    combined_bytes,
    linear_input_groups,
    loss_transient_bytes,
)
from actors.engine.adapter_surgery import add_adapter, remove_adapter, set_adapters_training
from actors.engine.layout import step_layout
from actors.engine.lora_targets import match_targets
from actors.engine.memory import measure_allocations
from actors.engine.memory_prior import TERMS_KEPT
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.recompute import recomputed_layers
from actors.spec.lora_config import LoraConfig

PROBE_JOB = "aspen-stage-memory-probe"
PROBE_SEQUENCE = 128


@dataclass(frozen=True, kw_only=True)
class StageActivation:
    """One stage's activation bytes, measured, the probe adapter's own taken out: `saved_*` live after a
    forward (kept for its backward), `step_*` a forward-and-backward's peak over what was live before, as
    constant + per_token * T; and what the jobs' adapters add is analytic (`adapter_activations.adapter_bytes`) over
    this stage's linear layers (`linear_shapes`, `input_groups`: which read the same tensor)."""

    saved_constant: float
    saved_per_token: float
    step_constant: float
    step_per_token: float
    linear_shapes: dict[str, tuple[int, int]]
    input_groups: dict


def _line(tokens: list[int], values: list[int]) -> tuple[float, float]:
    slope = max((values[1] - values[0]) / (tokens[1] - tokens[0]), 0.0)
    return max(values[0] - slope * tokens[0], 0.0), slope


def probe_stage_activation(model: StageModel, *, recompute: str = "none",
                           sequence: int = PROBE_SEQUENCE) -> StageActivation:
    """Two probe micro-batches (one and two sequences of `sequence` tokens) through this stage's layers with a
    rank-1 adapter on every linear layer: the previous stage's hidden states random (stage 0: token ids), the
    gradient of its output random (the last stage: of the hidden states' sum of squares, the loss's own
    bytes being analytic: `StageMemory.loss_bytes`)."""
    base = model.base
    config = base.model.config
    length = min(sequence, int(getattr(config, "max_position_embeddings", sequence) or sequence))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, int(config.vocab_size), (length,), generator=generator).tolist()
    example = Example(input_ids=tuple(ids), labels=tuple(ids))
    lora = LoraConfig(r=1, alpha=1, target_modules="all-linear")
    handle = add_adapter(base.model, PROBE_JOB, lora, seed=0)
    set_adapters_training(base.model, True)
    names = list(handle.layers)
    shapes = {name: (base.model.get_submodule(name).in_features, base.model.get_submodule(name).out_features)
              for name in handle.layers}
    tokens, saved, steps = [], [], []
    groups: dict = {}
    try:
        for rows in (1, 2):
            micro_batch = JobMicroBatch(job=PROBE_JOB, examples=[example] * rows)
            batch = pack([micro_batch], "packed", base.pad_token_id).to(base.device)
            hidden = None
            if not model.first:
                hidden = torch.randn(batch.num_tokens, model.hidden_size, generator=generator).to(
                    base.device, base.dtype).requires_grad_(True)

            def forward(batch=batch, hidden=hidden) -> torch.Tensor:
                with step_layout(batch.layout), recomputed_layers(model.view, recompute):
                    return model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)

            def forward_backward(forward=forward) -> None:
                output = forward()
                if model.last:
                    output.float().pow(2).sum().backward()
                else:
                    output.backward(torch.ones_like(output))

            forward_backward()   # a first pass: lazily built state (rotary caches, kernels) exists from here on
            if not groups:
                groups = linear_input_groups(base.model, forward)
            output, _, live = measure_allocations(forward, base.device)
            del output
            _, peak, _ = measure_allocations(forward_backward, base.device)
            probe = adapter_bytes([(lora, names, batch.num_tokens)], shapes, groups, base.dtype,
                                  compute_path=lora_cuda.applies(base.device, base.dtype))
            tokens.append(batch.num_tokens)
            saved.append(live - probe)
            steps.append(peak - probe)
    finally:
        remove_adapter(base.model, PROBE_JOB)
        for parameter in base.model.parameters():
            parameter.grad = None
    saved_constant, saved_per_token = _line(tokens, saved)
    step_constant, step_per_token = _line(tokens, steps)
    return StageActivation(saved_constant=saved_constant, saved_per_token=saved_per_token, step_constant=step_constant,
                           step_per_token=step_per_token, linear_shapes=shapes, input_groups=groups)


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """One stage's memory model: `predict(tokens)` its peak while micro-batches of `tokens` tokens pass."""

    stage: int
    stages: int
    held: int                      # live between steps: weights, adapters, AdamW moments, gradients
    activation: StageActivation
    vocab: int
    hidden: int
    dtype: torch.dtype
    loss_chunk: int
    compute_path: bool = False     # plain adapters take the CUDA LoRA path here (`lora_cuda.applies`)

    def in_flight(self) -> int:
        """Micro-batches forwarded and not yet backwarded here at most (1F1B)."""
        return self.stages - self.stage

    def loss_bytes(self, targets: int) -> int:
        return loss_transient_bytes(targets, self.vocab, self.hidden, self.dtype, self.loss_chunk) \
            if self.stage == self.stages - 1 else 0

    def adapters(self, plan: list[tuple[LoraConfig, int]]) -> int:
        """What a micro-batch's adapters keep here: per job its LoRA config and tokens."""
        return combined_bytes([(_terms(self.activation, lora, self.dtype, self.compute_path), tokens)
                               for lora, tokens in plan])

    def predict(self, plan: list[tuple[LoraConfig, int]], held: int | None = None) -> int:
        """The stage's peak while micro-batches like `plan` (per job its LoRA config and tokens; the largest a
        loop step composes) fill it: held, S - s - 1 of them saved, one at its backward's peak."""
        a = self.activation
        tokens = sum(count for _, count in plan)
        adapters = self.adapters(plan)
        saved = a.saved_constant + a.saved_per_token * tokens + adapters
        step = a.step_constant + a.step_per_token * tokens + adapters
        return int((self.held if held is None else held) + (self.in_flight() - 1) * saved + step
                   + self.loss_bytes(tokens))


_TERMS: dict[tuple, tuple[StageActivation, LoraConfig, AdapterTerms]] = {}
_INTERNED: dict[AdapterTerms, AdapterTerms] = {}


def _terms(activation: StageActivation, lora: LoraConfig, dtype: torch.dtype, compute_path: bool) -> AdapterTerms:
    """A job's `AdapterTerms` on a stage, kept per stage and LoRA config: a step's jobs are asked for again and
    again while it is composed (`memory_prior.StepMemoryPrior.terms` likewise)."""
    key = (id(activation), id(lora), dtype, compute_path)
    entry = _TERMS.get(key)
    if entry is None or entry[0] is not activation or entry[1] is not lora:   # (both kept: their ids stay theirs)
        if len(_TERMS) >= TERMS_KEPT:
            _TERMS.clear()
            _INTERNED.clear()
        names = match_targets(list(activation.linear_shapes), lora.target_modules)
        terms = adapter_terms(lora, names, activation.linear_shapes, activation.input_groups, dtype,
                              compute_path=compute_path)
        entry = _TERMS[key] = (activation, lora, _INTERNED.setdefault(terms, terms))   # equal terms: one object
    return entry[2]
