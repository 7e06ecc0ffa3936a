"""What a fused step will need in memory, before it runs: the trainer's memory model's prior.

    peak ≈ held + c0 + a·T + adapter_bytes(jobs) (+ the loss's bytes where they rise above that)

held: what the trainer holds between steps (weights, adapters, optimizer state; measured by counting the
live tensors). a and c0: the base model's own activation bytes per token and fixed step overhead, MEASURED
once at start on this very model, dtype, quantization, layout and recompute mode (`probe_base_activation`:
two small steps through a rank-1 probe adapter, their peaks counted by the allocator, `memory.measure_peak`)
rather than derived from a formula that each architecture, dtype, NF4 dequantisation and attention kernel
would break in its own way. The adapters' own per-token activations and the loss's transient depend on
each job's LoRA config and on the step's targets, not on the base: those two are analytic
(actors/engine/adapter_activations.py) and added per step.

On CPU the budget is the process's memory: `predict_resident` turns a step's predicted allocator peak into
the process's peak resident set (VmHWM), from the resident set measured with the libraries warm and the
probe-measured bytes beyond the allocator's count: the pages glibc's heap touches beyond the live tensors
(freed blocks that a later, larger one cannot reuse; kept resident, and reused by the next steps) and the
scratch torch's allocator does not hand out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from actors.data import Example
from actors.engine import experts_lora, lora_cuda
from actors.engine.adapter_activations import (
    AdapterTerms,
    adapter_bytes,
    adapter_terms,
    combined_bytes,
    example_targets,
    linear_input_groups,
    loss_transient_bytes,
)
from actors.engine.loss import DEFAULT_CHUNK
from actors.engine.memory import measure_allocations, measure_resident, release_free_heap, resident_measurable
from actors.engine.models import BaseModel
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig

PROBE_RANK = 1
PROBE_ROWS = (2, 3)   # sequences in the probe's two steps
# glibc's dynamic mmap threshold rises up to this (64-bit): blocks above it are always mapped, and given back
# when freed; blocks up to it end up in the heap, whose freed pages stay resident
HEAP_BLOCK_CEILING = 32 << 20
TERMS_KEPT = 1024   # jobs' LoRA configs whose AdapterTerms a prior keeps (all of them at once, then afresh)


@dataclass(frozen=True, kw_only=True)
class BaseActivation:
    """Measured on the model, over what the trainer holds, as straight lines in the step's tokens T (the
    base's part; the adapters' and the loss's analytic bytes come on top):
    - `constant + per_token·T`: the step's peak when the loss is negligible (the peak then lies in
      backward: every saved activation plus the first layers' gradient buffers);
    - `forward_constant + forward_per_token·T`: what is live when the forward pass ends and the loss
      begins (the saved activations and the final hidden states); the loss's own bytes come on top of it,
      so a step peaks at the larger of the two."""

    constant: float
    per_token: float
    forward_constant: float
    forward_per_token: float
    layers: int
    input_groups: dict
    loss_scale: float = 1.0   # measured share of `loss_transient_bytes` that is live on top of the forward's end
    # CPU, probe-measured: what a step adds to the process's resident set beyond the allocator's count (the
    # heap's pages beyond the live tensors, scratch torch's allocator does not hand out): constant + per
    # token, and during the loss per target
    resident_constant: float = 0.0
    resident_per_token: float = 0.0
    resident_per_target: float = 0.0

    @property
    def bytes_per_adapter_parameter(self) -> float:
        """Held per adapter parameter at the peak: the float32 weight and two AdamW moments, and the
        gradients of the layers backward has reached (the last one, at the backward peak)."""
        return 12.0 + 4.0 / self.layers

    def backward_peak(self, tokens: int) -> float:
        return self.constant + self.per_token * tokens

    def forward_end(self, tokens: int) -> float:
        return self.forward_constant + self.forward_per_token * tokens


def _line(tokens: list[int], values: list[float]) -> tuple[float, float]:
    slope = max((values[1] - values[0]) / (tokens[1] - tokens[0]), 0.0)
    return values[0] - slope * tokens[0], slope


def probe_base_activation(base: BaseModel, *, layout: str = "packed", recompute: str = "none",
                          loss_chunk: int = DEFAULT_CHUNK, sequence: int = 128) -> BaseActivation:
    """Probe steps of two and three sequences of `sequence` tokens (one target each: the loss negligible)
    through a rank-1 adapter on every linear layer; each step's peak, and what is live at the end of its
    forward pass, counted by the allocator (`memory.measure_allocations`); the probe adapter's analytic
    bytes taken out; a straight line through the two points of each. On CPU each probe step also runs once
    unprofiled, after the heap's free pages were given back (`memory.release_free_heap`), its resident set's
    peak read from the kernel (VmHWM, `memory.measure_resident`): what it adds beyond the allocator's count
    (the heap's pages beyond the live tensors; scratch torch's allocator does not hand out; the loss's, per
    target token, from the step whose every token is a target) is the prior's `resident_*` part. The probe
    ends by giving the heap's free pages back, so that the resident set is then what is live."""
    from actors.engine.adapter_surgery import linear_module_names, remove_adapter
    from actors.engine.job import TrainingJob
    from actors.engine.layout import step_layout
    from actors.engine.packing import JobMicroBatch, pack
    from actors.engine.recompute import decoder_layers, recomputed_layers
    from actors.engine.trainer import FusedTrainer

    model = base.model
    config = model.config
    vocab = int(config.vocab_size)
    length = min(sequence, int(getattr(config, "max_position_embeddings", sequence) or sequence))
    spec = JobSpec(name="aspen-memory-probe", data="-", format={"type": "text"}, batch_size=2, max_steps=100,
                   warmup_steps=0, lora={"r": PROBE_RANK, "alpha": PROBE_RANK, "dropout": 0.0,
                                         "target_modules": "all-linear"})
    names = linear_module_names(model)
    linear_shapes = {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features) for n in names}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (length,), generator=generator).tolist()
    example = Example(tuple(ids), tuple([-100] * (length - 1) + ids[-1:]))
    trainer = FusedTrainer(base, step_tokens=max(PROBE_ROWS) * length, layout=layout, loss_chunk=loss_chunk,
                           recompute=recompute)
    job = TrainingJob.create(spec, base, [example] * 4, [], seed=0)
    trainer.add_job(job)

    def forward(rows: int) -> torch.Tensor:
        batch = pack([JobMicroBatch(job.name, [example] * rows)], layout, base.pad_token_id).to(base.device)
        with step_layout(batch.layout), recomputed_layers(base.decoder, recompute):
            return base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                attention_mask=None, use_cache=False).last_hidden_state

    tokens, peaks, ends = [], [], []
    full_rows = [Example(tuple(ids), tuple(ids))] * PROBE_ROWS[0]   # every token a target
    residents, growths = [], []
    measure_rss = base.device.type == "cpu" and resident_measurable()
    layers = len(decoder_layers(base.decoder))
    groups = linear_input_groups(model, lambda: forward(1))

    compute_path = lora_cuda.applies(base.device, base.dtype)

    def probe_adapter(rows: int) -> float:
        return adapter_bytes([(spec.lora, names, rows * length)], linear_shapes, groups, base.dtype,
                             compute_path=compute_path)

    def adapter_share(rows: int) -> float:
        adapter = probe_adapter(rows)
        return adapter / layers if recompute == "layers" else adapter * (layers - 0.5) / layers

    try:
        # two and three sequences: a step of one sequence skips the joining of the segments' attention outputs
        # (measured: its marginal bytes a token are 5% below every later sequence's), so a line through one and
        # two would be steeper than steps of several sequences are
        for rows in PROBE_ROWS:
            batch = [example] * rows
            trainer.run_step([(job, batch)])   # a first step: the optimizer state exists from here on
            if measure_rss:   # the same step unprofiled, from a heap with no free page resident: what it touches
                release_free_heap()
                _, resident = measure_resident(lambda batch=batch: trainer.run_step([(job, batch)]))
                residents.append(resident)
            _, growth, _ = measure_allocations(lambda batch=batch: trainer.run_step([(job, batch)]), base.device)
            growths.append(growth)
            hidden, _, live = measure_allocations(lambda rows=rows: forward(rows), base.device)
            if rows == len(full_rows):
                raw = (growth, live)   # beside the full-target step of the same tokens below
            del hidden
            adapter = probe_adapter(rows)
            tokens.append(rows * length)
            peaks.append(growth - adapter_share(rows))
            ends.append(live - (0 if recompute == "layers" else adapter))
        # the same step with every token a target: how much of the loss's bytes lie above the backward peak
        full = full_rows
        trainer.run_step([(job, full)])
        if measure_rss:
            release_free_heap()
            _, full_resident = measure_resident(lambda: trainer.run_step([(job, full)]))
            residents.append(full_resident)
        _, full_growth, _ = measure_allocations(lambda: trainer.run_step([(job, full)]), base.device)
        loss = loss_transient_bytes(example_targets(full), vocab, int(config.hidden_size), base.dtype,
                                    loss_chunk)
    finally:
        trainer.jobs.pop(job.name, None)
        remove_adapter(model, job.name)
        if measure_rss:   # what the probe's steps left in the heap goes: the resident set is then what is live
            release_free_heap()
    measured = ProbeMeasurements(tokens=tokens, peaks=peaks, ends=ends, backward=raw[0], forward_end=raw[1],
                                 full_growth=full_growth, loss=loss, residents=residents, growths=growths,
                                 full_tokens=sum(len(e) for e in full), full_targets=example_targets(full))
    return fit_activation(measured, layers=layers, input_groups=groups)


@dataclass(frozen=True, kw_only=True)
class ProbeMeasurements:
    """What `probe_base_activation`'s steps measured: per probe step (two and three sequences) its tokens, its
    peak and what was live at its forward's end (the probe adapter's analytic bytes taken out of each); the
    three-sequence step's raw backward peak and forward end beside its full-target twin's peak (`full_growth`)
    and that twin's analytic loss bytes; on CPU each step's resident-set peak (`residents`, the full-target
    step's last) beside the allocator's growth (`growths`)."""

    tokens: list[int]
    peaks: list[float]
    ends: list[float]
    backward: float
    forward_end: float
    full_growth: float
    loss: float
    residents: list[float]
    growths: list[float]
    full_tokens: int
    full_targets: int


def fit_activation(measured: ProbeMeasurements, *, layers: int, input_groups: dict) -> BaseActivation:
    """The prior's lines through the probe's measurements (`BaseActivation` says what each is)."""
    constant, per_token = _line(measured.tokens, measured.peaks)
    forward_constant, forward_per_token = _line(measured.tokens, measured.ends)
    # a loss that raised the peak tells its live share; one hidden under the backward peak bounds it
    backward, forward_end = measured.backward, measured.forward_end
    above = measured.full_growth if measured.full_growth > backward * 1.01 else backward
    loss_scale = max(above - forward_end, 0.0) / max(measured.loss, 1)
    resident: dict[str, float] = {}   # no resident measure: the fields keep their defaults (0)
    if measured.residents:   # the resident set's growth beyond the allocator's count: per token, and the loss's
        # the last resident (the full step's) has no growth beside it: zip stops before it
        excess = [max(r - g, 0.0) for r, g in zip(measured.residents, measured.growths, strict=False)]
        # a line through the origin (least squares): the heap's pages come in lumps of a few pages to a few
        # MB, which a line through two points this close together would turn into a slope off by half
        tokens = measured.tokens
        resident_constant = 0.0
        resident_per_token = sum(e * t for e, t in zip(excess, tokens, strict=True)) / sum(t * t for t in tokens)
        # the full step's resident peak lies in its loss: what is live then (the forward's end, the adapters'
        # activations, the loss's counted bytes) plus the loss's uncounted scratch, per target token
        loss_phase = (forward_end + loss_scale * measured.loss + resident_constant
                      + resident_per_token * measured.full_tokens)
        resident = {"resident_constant": resident_constant, "resident_per_token": resident_per_token,
                    "resident_per_target": max(measured.residents[2] - loss_phase, 0.0) / measured.full_targets}
    return BaseActivation(constant=constant, per_token=per_token, forward_constant=forward_constant,
                          forward_per_token=forward_per_token, layers=layers, input_groups=input_groups,
                          loss_scale=loss_scale, **resident)


class StepMemoryPrior:
    """The analytic and probed parts of a step's peak, for the trainer's memory model (its features and
    their prior coefficients: `policies.memory_model`)."""

    def __init__(self, base: BaseModel, activation: BaseActivation, linear_shapes: dict[str, tuple[int, int]],
                 loss_chunk: int = DEFAULT_CHUNK, recompute: str = "none"):
        self.base = base
        self.recompute = recompute
        self.activation = activation
        self.linear_shapes = linear_shapes
        self.loss_chunk = loss_chunk
        config = base.model.config
        self.vocab = int(config.vocab_size)
        self.hidden = int(config.hidden_size)
        self._targets: dict[tuple, list[str]] = {}
        self._terms: dict[tuple[int, bool], tuple[LoraConfig, AdapterTerms]] = {}
        self._interned: dict[AdapterTerms, AdapterTerms] = {}

    def adapted(self, lora: LoraConfig) -> list[str]:
        from actors.engine.lora_targets import match_targets

        key = tuple(lora.target_modules) if isinstance(lora.target_modules, list) else lora.target_modules
        if key not in self._targets:
            self._targets[key] = match_targets(list(self.linear_shapes), lora.target_modules)
        return self._targets[key]

    def terms(self, lora: LoraConfig, compute_path: bool) -> AdapterTerms:
        """A job's `AdapterTerms` on this base, kept per LoRA config (a step's jobs are asked for again and again
        while a step is composed: what a job's adapters keep per token is counted once, not per layer each time)."""
        key = (id(lora), compute_path)
        entry = self._terms.get(key)
        if entry is None or entry[0] is not lora:   # (the config itself kept, so that its id is not reused)
            if len(self._terms) >= TERMS_KEPT:
                self._terms.clear()
                self._interned.clear()
            terms = adapter_terms(lora, self.adapted(lora), self.linear_shapes, self.activation.input_groups,
                                  self.base.dtype, compute_path=compute_path)
            if lora.target_parameters:   # LoRA on expert stacks (actors/engine/experts_lora.py)
                per_token, kept = experts_lora.activation_bytes(self.base.model, lora)
                terms = dataclasses.replace(terms, per_token=terms.per_token + per_token,
                                            kept_inputs=terms.kept_inputs + kept)
            entry = self._terms[key] = (lora, self._interned.setdefault(terms, terms))   # equal terms: one object
        return entry[1]

    def analytic_bytes(self, parts: list[tuple[LoraConfig, int, list[Example]]], *, resident: bool = False) -> int:
        """A step's bytes beyond the base's backward peak: its adapters' activations (with recomputation,
        one layer's share: only the layer being recomputed holds them), and what the loss needs beyond that
        peak (the forward pass's end plus the loss's own bytes, where that is higher). `parts`: per job its
        LoRA config, its tokens in the step (padding included) and its examples. `resident` (CPU): what the
        process's resident set adds beyond the allocator's peak comes on top (`BaseActivation.resident_*`:
        scratch the allocator does not count, during the whole step and during the loss)."""
        compute_path = lora_cuda.applies(self.base.device, self.base.dtype)
        adapters = combined_bytes([(self.terms(lora, compute_path), tokens) for lora, tokens, _ in parts])
        tokens = sum(t for _, t, _ in parts)
        targets = sum(example_targets(examples) for _, _, examples in parts)
        activation = self.activation
        loss = activation.loss_scale * loss_transient_bytes(targets, self.vocab, self.hidden, self.base.dtype,
                                                            self.loss_chunk)
        layers = activation.layers
        if self.recompute == "layers":   # checkpointed layers keep no adapter tensors until recomputed
            backward, forward = adapters / layers, 0.0
        else:   # at the backward peak the last layer has freed about half of what it kept
            backward, forward = adapters * (layers - 0.5) / layers, adapters
        if resident:
            loss += activation.resident_per_target * targets
        excess = activation.forward_end(tokens) + forward + loss - activation.backward_peak(tokens) - backward
        uncounted = 0.0
        if resident:
            uncounted = (activation.resident_constant + activation.resident_per_token * tokens
                         + self.heap_block_slack(targets))
        return int(backward + max(0.0, excess) + uncounted)

    def heap_block_slack(self, targets: int) -> int:
        """The heap's room for a step's largest block, the loss's float32 logits chunk, where glibc keeps it in
        the heap (up to HEAP_BLOCK_CEILING): once a block of the trainer's lasting state (an optimizer's
        moments, a gradient) lands in the pages a freed chunk left, the next chunk extends the heap by its own
        size, and the resident set keeps it. Seen as one such jump within a run's first steps, not as a
        steady creep (tests/unit/engine/test_memory.py; docs/benchmarks.md, memory)."""
        block = min(self.loss_chunk, targets) * self.vocab * 4
        return block if block <= HEAP_BLOCK_CEILING else 0


def predict_resident(resident_bytes: int, held_bytes: int, step_peak_bytes: int, resident_excess_bytes: int,
                     peak_so_far_bytes: int = 0) -> int:
    """A CPU trainer's peak resident set (VmHWM) once it runs a step, predicted before the step:
    `resident_bytes`, the process's resident set now, with the libraries warm (measured after the probe
    steps: interpreter, torch and the code and scratch its kernels mapped, the weights, what the trainer
    holds: `held_bytes` of live tensors), minus what it holds, plus the step's predicted allocator peak
    (which holds the weights, the adapters and their optimizer state, the step's activations), plus what the
    step's scratch adds beyond the allocator's count (`StepMemoryPrior.analytic_bytes(parts, resident=True)`
    minus `analytic_bytes(parts)`: probe-measured);
    at least the peak already reached (`peak_so_far_bytes`: loading the model, the probe). With glibc's
    malloc as it is: the probe measured the pages a step's heap touches from a heap with no free page
    resident, which is where `probe_base_activation` leaves it; later steps reuse what the earlier ones left
    resident, so the peak stays near this (tests/unit/engine/test_memory.py; bench/memory.py prints it per
    configuration)."""
    step = resident_bytes - held_bytes + step_peak_bytes + resident_excess_bytes
    return int(max(step, peak_so_far_bytes))
