"""Step admission: whether a fused step fits the trainer's memory budget (its predicted peak plus a margin),
and the step-memory model behind it, fitted on the allocator's counts of past steps. On a CPU the peak that
counts is the process's resident set (what the kernel kills for): the allocator's predicted peak plus the
process's runtime (interpreter, libraries, scratch: measured once after the probe) and what the step's
scratch and the heap add beyond the allocator's count (`memory_prior`, probe-measured)."""

from __future__ import annotations

import collections
import functools
import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from actors.data import Example
from actors.engine.adapter_activations import loss_transient_bytes
from actors.engine.adapter_surgery import linear_module_names
from actors.engine.experts_lora import stack_shapes
from actors.engine.grpo import SAMPLING_SIZES, sampling_bytes
from actors.engine.memory import live_tensor_bytes, process_peak_resident_bytes, resident_bytes
from actors.engine.memory_prior import StepMemoryPrior, predict_resident
from actors.engine.packing import JobMicroBatch
from actors.engine.probe_cache import cached_probe
from actors.engine.step_report import StepReport
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from actors.spec.trainer_settings import AUTO_STEP_TOKENS_FLOOR
from policies.memory_model import MemoryModel, StepShape

if TYPE_CHECKING:
    from actors.service.scheduler.config import TrainerConfig

log = logging.getLogger(__name__)

MEASURE_FIRST = 3      # CPU: the first steps whose peak the allocator counts (the memory model's first data)
MEASURE_EVERY = 20     # CPU: and every this many steps after
AUTO_STEP_TOKENS_CEILING = 8192   # `step_tokens: auto` on a GPU plans at most this (`plan_step_tokens`)
# `step_tokens: auto` on a CPU composes steps of this many tokens (a job's micro-batch up to auto's floor still runs,
# alone): a CPU's products run no faster in larger steps, while the activations the resident set holds grow with
# them (bench/versus_peft.py, smollm2-135m float32, 4 jobs, AMD EPYC 2 cores: 4096 / 2048 / 1536 / 1024 tokens:
# 211 / 232-246 / 241 / 258 tokens/s, peak resident set 6.28 / 4.47-4.56 / 3.66 / 3.09 GiB)
AUTO_CPU_STEP_TOKENS = 1024
MEMORY_MARGIN = 0.06   # a step is composed only if its predicted peak plus this share fits the budget (the
                       # prediction's goal is 6% at most off the allocator; bench/memory.py measured 4.7% low once)


def default_memory_budget(device: torch.device, gpu_share: float = 1.0, ram_share: float = 1.0) -> int:
    """90% of the GPU (times `gpu_share`: a trainer holding `num_gpus` below 1 shares its GPU with others, each of
    which would otherwise plan for 90% of it), or half the RAM (times `ram_share`: the CPU trainers' processes on one
    node share it, service/scheduler/cluster_plan.py)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9 * gpu_share)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.5 * ram_share)


def cpu_budget_config(config: TrainerConfig, ram_share: float) -> TrainerConfig:
    """`config` with its memory budget set to its share of half this node's RAM, for a CPU trainer that shares the
    node with other CPU trainers (`ram_share` below 1) and sets no budget of its own; else `config` as it is."""
    if config.memory_budget_bytes is not None or config.num_gpus > 0 or ram_share >= 1:
        return config
    if not 0 < ram_share:
        raise ValueError(f"a trainer's share of its node's RAM must be above 0, not {ram_share}")
    budget = default_memory_budget(torch.device("cpu"), ram_share=ram_share)
    return config.model_copy(update={"memory_budget_bytes": budget})


def memory_in_use(device: torch.device) -> int:
    """Memory held right now: the CUDA allocator's allocated bytes, or this process's resident set on CPU
    (Linux's /proc/self/statm; 0, with a warning once, where there is none)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError as error:
        _warn_once(f"memory in use is reported as 0: cannot read the resident set size ({error})")
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


class StepAdmission:
    """A trainer's memory admission. Its prior: the base's activation bytes per token measured on this model
    (dtype, quantization, layout, recompute mode) by two small probe steps (actors/engine/memory_prior.py),
    the adapters' and the loss's bytes analytic per step; then fitted online (policies/memory_model.py) on the
    steps whose peak the allocator counted. `budget_bytes`: None for the device's default budget."""

    def __init__(self, trainer: FusedTrainer, budget_bytes: int | None = None):
        base, model = trainer.base, trainer.base.model
        self.trainer = trainer
        self.base_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        self.budget = budget_bytes or default_memory_budget(base.device)
        self.linear_shapes = {name: (model.get_submodule(name).in_features, model.get_submodule(name).out_features)
                              for name in linear_module_names(model)}
        self.expert_shapes = stack_shapes(model)
        # measured by probe steps, or as an earlier start on this model and setting measured them (probe_cache.py)
        activation = cached_probe(base, layout=trainer.layout, recompute=trainer.recompute)
        self.memory_prior = StepMemoryPrior(base, activation, self.linear_shapes, recompute=trainer.recompute)
        self.memory_model = MemoryModel.for_model(self.base_bytes + activation.constant, activation.per_token,
                                                  bytes_per_adapter_parameter=activation.bytes_per_adapter_parameter)
        self.measured_steps = 0
        self._parameters: tuple[list[weakref.ref], int] = ([], 0)   # `adapter_parameters`: (its jobs, their count)
        self.under_predictions: collections.deque[float] = collections.deque(maxlen=100)
        # CPU: the process's resident set is the budget's measure (None where the allocator's count is)
        self.resident = ResidentPeaks.of(trainer) if trainer.resident_measured else None

    @property
    def activation_estimate(self) -> int:
        """A full step's bytes over the weights before any step was measured (the scheduler's first guess); on a
        CPU as the resident set counts them (the budget's measure there): with the process's runtime and the
        scratch and heap beyond the allocator's count (every token a target). The probe's figures alone, never
        what the steps taught since: the scheduler judges "this job can never run here" against it, and a
        resident scale learned while two large adapters trained (the heap keeps pages a freed adapter left) once
        filled a trainer's whole budget with it, so a queued job was failed that fitted once they had gone."""
        activation, tokens = self.memory_prior.activation, self.trainer.step_tokens
        estimate = (activation.constant + activation.per_token * tokens
                    + loss_transient_bytes(tokens, self.memory_prior.vocab, self.memory_prior.hidden,
                                           self.trainer.base.dtype))
        if self.resident is not None:
            estimate += self.resident.runtime_bytes + (
                activation.resident_constant + (activation.resident_per_token + activation.resident_per_target) * tokens
                + self.memory_prior.heap_block_slack(tokens))
        return int(estimate)

    def plan_step_tokens(self, gpu: bool | None = None) -> int:
        """`step_tokens: auto`: on CPU AUTO_CPU_STEP_TOKENS; on a GPU the largest multiple of 1024 tokens up to
        AUTO_STEP_TOKENS_CEILING whose step (a job of rank 16 on every linear layer, every token a target: the
        loss's largest bytes), raised by the margin, fits the budget beside the weights, by this trainer's memory
        prior. Larger steps make the base's products larger (closer to the GPU's ceiling) and cost fewer launches
        per token; past ~8k tokens a 4096-wide layer's products gain little, while a step's jobs wait longer for
        their updates. Where even the floor does not fit, the largest that does (at least 1024), with a hint.
        `gpu`: plan as on a GPU (default: where the base is)."""
        if not (self.trainer.base.device.type == "cuda" if gpu is None else gpu):
            return AUTO_CPU_STEP_TOKENS
        planned = next((t for t in range(AUTO_STEP_TOKENS_CEILING, 1023, -1024)
                        if self.predict(self._largest_step(t)) * (1 + self.margin) <= self.budget), 1024)
        if planned < AUTO_STEP_TOKENS_FLOOR:
            log.warning("step_tokens auto: only %d tokens a step fit the memory budget of %d MiB beside the base; "
                        "recompute: layers (less activation memory, half more of the step's matrix products) or "
                        "a quantized base would allow larger steps", planned, self.budget >> 20)
        return planned

    def _largest_step(self, tokens: int) -> StepShape:
        """The shape of a step of `tokens` at its largest: a rank-16 adapter on every linear layer, every token a
        target (the loss's largest bytes)."""
        lora = LoraConfig(r=16, alpha=32, target_modules="all-linear")
        parameters = 2 * 16 * sum(i + o for i, o in self.linear_shapes.values())
        example = Example(tuple(range(tokens)), tuple(range(tokens)))
        return StepShape.of([tokens], parameters, tokens=tokens,
                            analytic_bytes=self.memory_prior.analytic_bytes([(lora, tokens, [example])]))

    @property
    def margin(self) -> float:
        """MEMORY_MARGIN, or the largest share by which a measured peak has exceeded its prediction."""
        return max([MEMORY_MARGIN, *self.under_predictions])

    def shape(self, micro_batches: list[JobMicroBatch]) -> StepShape:
        """The step's features for the memory model (its jobs are the trainer's)."""
        trainer = self.trainer
        lengths = [len(e) for mb in micro_batches for e in mb.rows]
        parameters = self.adapter_parameters()
        parts = [(trainer.jobs[mb.job].spec.lora, tokens, mb.examples)
                 for mb, tokens in zip(micro_batches, trainer.job_step_tokens(micro_batches), strict=True)]
        analytic = self.memory_prior.analytic_bytes(parts)
        excess = self.memory_prior.analytic_bytes(parts, resident=True) - analytic if self.resident is not None else 0
        return StepShape.of(lengths, parameters, tokens=trainer.step_cost(micro_batches), analytic_bytes=analytic,
                            resident_excess_bytes=excess)

    def adapter_parameters(self) -> int:
        """The trainer's jobs' adapter parameters, counted again only when its jobs change (a step's candidates are
        each asked about while it is composed; a job's adapter keeps its size)."""
        jobs = list(self.trainer.jobs.values())
        counted, count = self._parameters
        if len(counted) != len(jobs) or any(ref() is not job for ref, job in zip(counted, jobs, strict=True)):
            count = sum(p.numel() for job in jobs for p in job.adapter.parameters())
            self._parameters = ([weakref.ref(job) for job in jobs], count)
        return count

    def predict(self, shape: StepShape) -> int:
        """The step's peak as the allocator counts it (the memory model's own figure)."""
        return self.memory_model.predict(shape)

    def predict_peak(self, shape: StepShape) -> int:
        """The step's peak as the budget counts it: on a CPU the process's resident set (`predict_resident`:
        the runtime, the allocator's peak, the scratch and heap beyond it), elsewhere the allocator's."""
        if self.resident is None:
            return self.predict(shape)
        return self.resident.predict(self.predict(shape), shape.resident_excess_bytes)

    def fits(self, micro_batches: list[JobMicroBatch], held_bytes: int = 0) -> bool:
        """Whether a step's predicted peak, raised by the margin its predictions have needed, fits the budget
        beside the memory `compile: graphs`' captured steps hold (`FusedTrainer.graph_held_bytes`) and
        `held_bytes` more (a sampling batch's KV cache between its slices)."""
        held = self.trainer.graph_held_bytes(micro_batches) + held_bytes
        return self.predict_peak(self.shape(micro_batches)) * (1 + self.margin) + held <= self.budget

    def pass_tokens(self, held_bytes: int) -> int:
        """The most tokens (up to the trainer's step, at least 1) of a pass of interactive calls whose predicted peak
        at its largest (`_largest_step`), raised by the margin, fits the budget beside `held_bytes` (a sampling
        batch's KV cache between its slices)."""
        def fits(tokens: int) -> bool:
            return self.predict_peak(self._largest_step(tokens)) * (1 + self.margin) + held_bytes <= self.budget

        low, high = 1, max(1, self.trainer.step_tokens)
        if fits(high):
            return high
        while low < high:   # the largest that fits (1 where none does: the pass then says why it failed)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    def sampling_refusal(self, spec: JobSpec) -> str | None:
        """Why a GRPO job's sampling could never fit this trainer's budget, or None: its largest rollout
        (batch_size prompts, num_generations completions each, max_seq_len + max_new_tokens tokens) beside the
        base's weights, raised by the margin."""
        config = spec.grpo
        if config is None:
            return None
        rows, width = spec.batch_size * config.num_generations, spec.max_seq_len + config.max_new_tokens
        need = sampling_bytes(self.trainer.base, rows, width)
        if (self.base_bytes + need) * (1 + self.margin) <= self.budget:
            return None
        return (f"sampling its completions ({rows} sequences of up to {width} tokens) needs some "
                f"{need / 2**20:.0f} MiB beside the base's {self.base_bytes / 2**20:.0f} MiB, more than the "
                f"trainer's memory budget of {self.budget / 2**20:.0f} MiB; {SAMPLING_SIZES}")

    def measure_next_step(self) -> bool:
        """Whether the allocator should count the next step's peak: on CPU (torch.profiler, slower) the first
        MEASURE_FIRST steps and every MEASURE_EVERY-th step after; on CUDA every step is counted anyway."""
        return self.measured_steps < MEASURE_FIRST or self.trainer.step_count % MEASURE_EVERY == 0

    def observe(self, shape: StepShape, report: StepReport, predicted: int) -> None:
        """Learn from a step that ran. The memory model: only from the allocator's count (a step that was not
        measured teaches nothing). The margin: a peak above its prediction raises it; on a CPU the step's own
        resident peak (VmHWM reset as it began: what a job's start or export raised between steps is not the
        step's), judged where it raised the peak the steps reached (a step below it shows no peak of its own),
        against the highest prediction so far (the heap keeps what an earlier step touched)."""
        if self.resident is not None and report.resident_peak_bytes is not None:
            under = self.resident.observe(self.predict_peak(shape), shape, report)
            if under is not None:
                self.under_predictions.append(under)
        if not report.memory_measured:
            return
        self.measured_steps += 1
        if self.resident is None:
            self.under_predictions.append((report.peak_memory_bytes - predicted) / report.peak_memory_bytes)
        self.memory_model.observe(shape, report.peak_memory_bytes, predicted)


class ResidentPeaks:
    """A CPU trainer's resident set as its budget counts it: the process's runtime beside the live tensors
    (interpreter, libraries, scratch: measured once, after the probe left the heap with no free page resident),
    the peak the steps reached so far, the highest prediction, and what the steps showed of the probe's
    scratch-and-heap estimate (its small steps' pages per token run above a full step's)."""

    def __init__(self, runtime_bytes: int, seen_bytes: int):
        self.runtime_bytes = runtime_bytes
        self.seen = seen_bytes   # the process's resident peak so far
        self.predicted = 0       # the highest step peak predicted so far
        # the shares of the probe's scratch-and-heap estimate the steps showed, once a step raised the peak
        self.scales: collections.deque[float] = collections.deque(maxlen=100)

    @classmethod
    def of(cls, trainer: FusedTrainer) -> ResidentPeaks:
        """Measured now: the resident set minus the tensors the trainer holds, and the process's peak."""
        held = live_tensor_bytes(trainer.base.model, [job.optimizer.optimizer for job in trainer.jobs.values()])
        return cls(max(resident_bytes() - held, 0), process_peak_resident_bytes())

    @property
    def scale(self) -> float:
        """The largest share of the scratch-and-heap estimate a step showed (1 before any did)."""
        return max(self.scales, default=1.0)

    def predict(self, allocator_peak: int, excess_bytes: int) -> int:
        """A step's resident peak (`predict_resident`): the runtime, the allocator's predicted peak, and the
        scratch and heap beyond it, scaled by what the steps showed."""
        return predict_resident(self.runtime_bytes, 0, allocator_peak, int(self.scale * excess_bytes))

    def observe(self, predicted: int, shape: StepShape, report: StepReport) -> float | None:
        """Learn from a step's own resident peak (VmHWM reset as it began), judged where it raised the peak the
        steps reached (a step below it shows no peak of its own), against the highest prediction so far (the heap
        keeps what an earlier step touched): the share by which it was under, or None where it taught nothing."""
        self.predicted = max(self.predicted, predicted)
        peak = report.resident_peak_bytes
        if peak is None or peak <= self.seen:
            return None
        self.seen = peak
        if shape.resident_excess_bytes > 0:   # the scratch and heap it showed beyond the allocator's count
            shown = peak - self.runtime_bytes - report.peak_memory_bytes
            self.scales.append(max(shown, 0) / shape.resident_excess_bytes)
        return (peak - self.predicted) / peak
