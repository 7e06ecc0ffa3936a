"""A pipeline trainer's memory admission: every stage's peak predicted before a loop step against the
trainer's budget, which is per stage. Each stage has a memory model of its own (policies/memory_model.py, as
one device's trainer has): its prior from the stage's probe (actors/engine/pipeline/stage_memory.py: its
activations per token measured on its own layers, 1F1B's in-flight bound, the adapters' and the loss's bytes
analytic), refitted online on the stage's measured peaks (the allocator's, counted over the loop step at
each stage: every step on CUDA; on CPU, through torch.profiler, the first steps and every 20th).

To the scheduler the trainer is one trainer: its status reports the critical stage (the one whose predicted
peak at a full step is highest): its weights as the base's bytes, a full step's bytes beyond them, its
memory model's coefficients and mean error. A job's adapter is counted whole there (it is spread over the
stages): on the safe side."""

from __future__ import annotations

import collections

from actors.engine.grpo import SAMPLING_SIZES
from actors.engine.packing import JobMicroBatch
from actors.engine.pipeline.stage_memory import StageMemory
from actors.engine.step_report import StepReport
from actors.service.pipeline.pipeline_engine import PipelineEngine
from actors.service.trainer.step_admission import MEASURE_EVERY, MEASURE_FIRST, MEMORY_MARGIN, default_memory_budget
from actors.spec.job_spec import JobSpec
from actors.spec.lora_config import LoraConfig
from policies.memory_model import MemoryModel, StepShape

BYTES_PER_ADAPTER_PARAMETER = 16   # held per adapter parameter: float32 weight, two AdamW moments, gradient


class PipelineAdmission:
    """`StepAdmission`'s calls and status attributes for a pipeline trainer (see the module's docstring)."""

    # the stages' memory is each stage process's own, counted by its allocator: no resident set of this process
    resident = None

    @property
    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """No MoE expert stacks: MoE bases train on one device (pipeline/stage_loading.py refuses them)."""
        return {}

    def __init__(self, engine: PipelineEngine, budget_bytes: int | None = None):
        self.engine = engine
        self.budget = budget_bytes or default_memory_budget(engine.base.device)
        self.stages: list[StageMemory] = engine.memory()   # no job yet: held = the stages' weights
        self.weights = [memory.held for memory in self.stages]
        for stage, weights in enumerate(self.weights):
            if weights >= self.budget:
                raise MemoryError(f"pipeline stage {stage}: its weights take {weights / 2**20:.0f} MiB, the memory "
                                  f"budget per stage is {self.budget / 2**20:.0f} MiB; raise memory_budget_bytes, "
                                  "cut the base into more stages, or give this stage fewer layers (stage_split)")
        self.models = [self._prior(memory) for memory in self.stages]
        self.under_predictions: collections.deque[float] = collections.deque(maxlen=100)
        self.shapes: list[StepShape] = []
        self.measured_steps = 0
        model = engine.base.model
        self.linear_shapes = {name: (model.get_submodule(name).in_features, model.get_submodule(name).out_features)
                              for name in engine.module_order}
        full = [(LoraConfig(), engine.step_tokens)]
        peaks = [m.predict(self._shape(memory, full)) for m, memory in zip(self.models, self.stages, strict=True)]
        self.critical = max(range(len(self.stages)), key=lambda s: peaks[s])
        self.base_bytes = self.weights[self.critical]
        self.activation_estimate = peaks[self.critical] - self.base_bytes

    @property
    def memory_model(self) -> MemoryModel:
        """The critical stage's (the trainer's status reports its coefficients and error)."""
        return self.models[self.critical]

    @staticmethod
    def _prior(memory: StageMemory) -> MemoryModel:
        a, extra = memory.activation, memory.in_flight() - 1
        return MemoryModel.for_model(int(memory.held + extra * a.saved_constant + a.step_constant),
                                     extra * a.saved_per_token + a.step_per_token,
                                     bytes_per_adapter_parameter=BYTES_PER_ADAPTER_PARAMETER)

    def _shape(self, memory: StageMemory, plan: list[tuple[LoraConfig, int]]) -> StepShape:
        """A stage's features for micro-batches like `plan`: their tokens, the adapter parameters it holds
        (what it holds beyond its weights), and the analytic bytes: the adapters' activations in each
        micro-batch in flight, and at the last stage the loss's."""
        tokens = sum(count for _, count in plan)
        held_adapters = max(memory.held - self.weights[memory.stage], 0) // BYTES_PER_ADAPTER_PARAMETER
        analytic = memory.in_flight() * memory.adapters(plan) + memory.loss_bytes(tokens)
        return StepShape(tokens=tokens, sum_squared_lengths=0, adapter_parameters=int(held_adapters),
                         analytic_bytes=int(analytic))

    @property
    def margin(self) -> float:
        return max([MEMORY_MARGIN, *self.under_predictions])

    def largest_plan(self, micro_batches: list[JobMicroBatch]) -> list[tuple[LoraConfig, int]]:
        """The largest micro-batch the head may compose of these jobs' (its `share` of them, within
        step_tokens): per job its LoRA config and tokens."""
        engine = self.engine
        share = engine.head.share(len(micro_batches))
        sized = sorted(((engine.jobs[mb.job].spec.lora, sum(len(e) for e in mb.rows)) for mb in micro_batches),
                       key=lambda part: -part[1])
        plan: list[tuple[LoraConfig, int]] = []
        for lora, tokens in sized:
            if len(plan) == share:
                break
            if plan and sum(t for _, t in plan) + tokens > engine.step_tokens:
                continue
            plan.append((lora, tokens))
        return plan

    def predictions(self, micro_batches: list[JobMicroBatch]) -> list[int]:
        """Each stage's predicted peak for a loop step of these micro-batches."""
        plan = self.largest_plan(micro_batches)
        return [model.predict(self._shape(memory, plan)) for model, memory in zip(self.models, self.stages,
                                                                                   strict=True)]

    def shape(self, micro_batches: list[JobMicroBatch]) -> StepShape:
        """The step's features (the critical stage's); every stage's kept for `observe`, their held bytes read
        afresh (jobs come and go between steps)."""
        self.stages = self.engine.memory()
        plan = self.largest_plan(micro_batches)
        self.shapes = [self._shape(memory, plan) for memory in self.stages]
        return self.shapes[self.critical]

    def predict(self, shape: StepShape) -> int:
        """The highest predicted stage peak of the step whose features `shape` made."""
        return max(model.predict(stage_shape) for model, stage_shape in zip(self.models, self.shapes, strict=True))

    def fits(self, micro_batches: list[JobMicroBatch]) -> bool:
        """Whether every stage's predicted peak, raised by the margin, fits the per-stage budget."""
        return all(peak * (1 + self.margin) <= self.budget for peak in self.predictions(micro_batches))

    def sampling_refusal(self, spec: JobSpec) -> str | None:
        """Why a GRPO job's sampling could never fit some stage's budget, or None: its largest rollout (batch_size
        prompts, num_generations completions each, max_seq_len + max_new_tokens tokens) over the stages, each
        stage the KV cache of its own layers (and the logits at the first and last) beside its weights, raised by
        the margin."""
        config = spec.grpo
        if config is None:
            return None
        rows, width = spec.batch_size * config.num_generations, spec.max_seq_len + config.max_new_tokens
        for stage, weights in enumerate(self.weights):
            need = self.engine.sampling_bytes(stage, rows, width)
            if (weights + need) * (1 + self.margin) > self.budget:
                return (f"sampling its completions ({rows} sequences of up to {width} tokens) needs some "
                        f"{need / 2**20:.0f} MiB at pipeline stage {stage} beside its weights' "
                        f"{weights / 2**20:.0f} MiB, more than the memory budget per stage of "
                        f"{self.budget / 2**20:.0f} MiB; {SAMPLING_SIZES}, or cut the base into more stages")
        return None

    def measure_next_step(self) -> bool:
        if self.engine.base.device.type == "cuda":
            return True
        return self.measured_steps < MEASURE_FIRST or self.engine.step_count % MEASURE_EVERY == 0

    def observe(self, shape: StepShape, report: StepReport, predicted: int) -> None:
        """Learn from each stage's measured peak (its model refitted); a peak above its prediction raises the
        margin."""
        peaks = self.engine.last_peaks
        if not report.memory_measured or len(peaks) != len(self.models):
            return
        self.measured_steps += 1
        for model, stage_shape, peak in zip(self.models, self.shapes, peaks, strict=True):
            before = model.predict(stage_shape)
            self.under_predictions.append((peak - before) / peak)
            model.observe(stage_shape, peak, before)
