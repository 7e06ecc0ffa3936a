"""The fused trainer: one frozen base model, many jobs, one forward/backward per step.

A step packs one micro-batch from each joining job into one token stream (grouped by job), runs the
base model once with each job's tokens through its own adapter, computes each job's loss as the mean
over its own target tokens (LM head only at target positions, in chunks), sums the jobs' losses, runs
one backward, and steps the optimizers of the jobs whose accumulation is complete (together:
`joint_steps.step_jobs`). Preference jobs (method dpo / orpo) share the step: their pairs' sequences are
packed beside the others' and their losses are functions of per-sequence log-probabilities
(actors/engine/preference.py); a DPO job's reference is the base without adapter (or its init_adapter, frozen:
actors/engine/job_references.py), from a no-grad forward of its new pairs before the step's forward (cached per
pair). GRPO jobs' prompts become sampled, scored
completions before the step (`rollouts`: actors/engine/grpo.py) and train beside the others. Interactive models'
forward_backward calls (the Tinker API's) may share it too: their datums after the jobs' tokens, their losses
added before the backward (actors/engine/interactive_step.py).

Which jobs join a step, and its cost in tokens: actors/engine/step_composition.py; what a step reports:
actors/engine/step_report.py."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from actors.data import Example
from actors.engine.adapter_surgery import AdapterHandle, remove_adapter, set_adapters_training
from actors.engine.compiled import CompiledLayers, check_compile
from actors.engine.fixed_shapes import FixedShape
from actors.engine.generate import decode
from actors.engine.generation_eval import GenerationEvaluation, generation_evaluations, generation_jobs
from actors.engine.graphed_steps import GraphedSteps
from actors.engine.grpo import step_rollouts
from actors.engine.interactive_step import FusedCalls, call_losses, with_calls
from actors.engine.job import BatchSource, TrainingJob
from actors.engine.job_references import JobReferences
from actors.engine.joint_steps import step_jobs
from actors.engine.layout import step_layout
from actors.engine.loss import DEFAULT_CHUNK, fused_loss, logits_transient_bytes
from actors.engine.loss_evaluation import adapter_logits, mean_loss
from actors.engine.memory import (
    StepMemoryMeter,
    live_tensor_bytes,
    measure_peak,
    peak_resident_bytes,
    reset_peak_resident,
)
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.preference import evaluate_preference
from actors.engine.recompute import decoder_layers, recomputed_layers
from actors.engine.step_batches import StepBatches
from actors.engine.step_composition import StepComposition
from actors.engine.step_graphs import GraphBackend, StepGraphs
from actors.engine.step_objective import ObjectiveJob, step_objective
from actors.engine.step_report import JobStepResult, StepReport
from actors.engine.user_calls import FunctionWorker
from actors.spec.base_settings import RECOMPUTE_MODES, Compile, Layout, Recompute
from actors.spec.job_spec import JobSpec
from actors.spec.method_config import PREFERENCE_METHODS
from policies.base import StepComposer

log = logging.getLogger(__name__)


class FusedTrainer:
    """One device's fused steps over the jobs added to it (`jobs`): which join a step (`composition`), its packed
    batch (`batches`), one forward/backward through each job's adapter, their optimizer steps; evaluation and
    generation between steps."""

    def __init__(self, base: BaseModel, *, step_tokens: int = 4096, layout: Layout = "packed",
                 loss_chunk: int = DEFAULT_CHUNK, composer: StepComposer | None = None,
                 recompute: Recompute = "none", compile: Compile = "none",
                 compile_backend: str | Callable = "inductor", graph_backend: GraphBackend | None = None):
        """`recompute`: "layers" keeps only each decoder layer's input for backward and runs the layer's
        forward again there (less activation memory, about a third more arithmetic); "none" keeps all.
        `compile`: "default" runs the decoder layers of each step under torch.compile (`compiled`: the stream
        padded to a bucket length) with `compile_backend`; "graphs" captures each step of a fixed shape as a CUDA
        graph and replays it (`graphs`: actors/engine/step_graphs.py; `graph_backend`: how, CUDA graphs by
        default); "none" eagerly."""
        check_compile(compile, recompute=recompute, quantization=base.quantization, layout=layout)
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, not '{recompute}'")
        if recompute == "layers":
            decoder_layers(base.decoder)   # a model without a layer stack is refused here, not at the first step
        self.recompute = recompute
        self.base = base
        self.step_tokens = step_tokens
        self.loss_chunk = loss_chunk
        self.jobs: dict[str, TrainingJob] = {}
        self.step_count = 0
        self.composition = StepComposition(self.jobs, composer, layout=layout, bucketed=compile == "default")
        self.meter = StepMemoryMeter(base.model, base.device)
        self.references = JobReferences(base)   # DPO jobs' reference caches; init_adapters that are a reference
        # compile: default's layers under torch.compile, or compile: graphs' captured steps (`graphs`), or None
        self.compiled: CompiledLayers | GraphedSteps | None = (
            CompiledLayers(base.decoder, backend=compile_backend) if compile == "default"
            else GraphedSteps(base, layout=layout, recompute=recompute, loss_chunk=loss_chunk, backend=graph_backend)
            if compile == "graphs" else None)
        # the steps' batches; on CUDA the next step's packed while this one runs (`_prepack_next`)
        self.batches = StepBatches(base, layout, bucketed=compile == "default", ahead=base.device.type == "cuda")
        self.functions = FunctionWorker()   # users' rewards and metrics: a process of their own, started if asked

    # -- what the trainer loop asks of any step engine (actors/service/trainer/step_engine.py) ----------------
    @property
    def lost(self) -> Exception | None:
        """One device never loses a pipeline stage."""
        return None

    @property
    def generation_refusal(self) -> str | None:
        """None: one device continues prompts ("try it")."""
        return None

    @property
    def layout(self) -> Layout:
        return self.composition.layout

    @property
    def composer(self) -> StepComposer | None:
        return self.composition.composer

    @property
    def resident_measured(self) -> bool:
        """Whether each step's peak resident set is measured (a CPU with Linux's /proc)."""
        return self.meter.resident

    # -- composing a step (actors/engine/step_composition.py) ------------------------------------------------
    def compose(self, jobs: list[TrainingJob] | None = None,
                fits: Callable[[list[JobMicroBatch]], bool] | None = None) -> list[tuple[TrainingJob, list[Example]]]:
        """Which of `jobs` (default: the active ones) join the next step, each with its next micro-batch: the
        step composer's choice, else round-robin within `step_tokens` and what `fits` allows."""
        return self.composition.compose(self.active_jobs if jobs is None else jobs, self.step_tokens,
                                        self.step_count, fits)

    def step_cost(self, micro_batches: list[JobMicroBatch]) -> int:
        """Tokens a step of these micro-batches processes, padding included (with `compile: default`, the bucket's;
        with `compile: graphs`, its fixed shape's)."""
        shape = self._graph_shape(micro_batches)
        return shape.tokens if shape is not None else self.composition.step_cost(micro_batches)

    def job_step_tokens(self, micro_batches: list[JobMicroBatch]) -> list[int]:
        """Tokens each micro-batch occupies in a step of these, padding included (the memory plan's per job)."""
        shape = self._graph_shape(micro_batches)
        if shape is not None:
            return list(shape.capacity)
        longest = max(len(e) for mb in micro_batches for e in mb.rows)
        return [mb.padded_tokens(self.layout, longest) for mb in micro_batches]

    def graph_held_bytes(self, micro_batches: list[JobMicroBatch]) -> int:
        """Device memory held by `compile: graphs`' captured steps beside a step of these micro-batches (their
        graphs' pools; a step that replays one runs in its pool): what the memory plan adds to the step's peak."""
        if not isinstance(self.compiled, GraphedSteps):
            return 0
        return self.compiled.held_bytes(self._graph_shape(micro_batches))

    def _graph_shape(self, micro_batches: list[JobMicroBatch]) -> FixedShape | None:
        """The fixed shape a graphed step of these micro-batches would take (`compile: graphs`, where their jobs can
        take one), else None."""
        if not isinstance(self.compiled, GraphedSteps) or any(mb.job not in self.jobs for mb in micro_batches):
            return None
        return self.compiled.shape([self.jobs[mb.job] for mb in micro_batches], micro_batches)

    # -- jobs -------------------------------------------------------------------------------------
    def add_job(self, job: TrainingJob) -> None:
        if job.name in self.jobs:
            raise ValueError(f"job '{job.name}' is already on this trainer")
        self.jobs[job.name] = job
        self.meter.refresh_weights()

    def attach(self, spec: JobSpec, source: BatchSource, eval_examples: list[Example], total_steps: int, *,
               seed: int) -> TrainingJob:
        """A job whose micro-batches come from `source`, its adapter on the base; not yet in the steps."""
        return TrainingJob.attach(spec, self.base, source, eval_examples, total_steps, seed=seed)

    def restored(self, job: TrainingJob) -> None:
        """A checkpoint was loaded into `job`: its tensors are already the ones the steps use."""

    def discard(self, name: str) -> None:
        """Take a job that could not start (attached, perhaps not added) off the base."""
        self.jobs.pop(name, None)
        self.references.drop(name)
        remove_adapter(self.base.model, name)

    def remove_job(self, name: str) -> TrainingJob:
        job = self.jobs.pop(name)
        self.composition.forget(name)
        self.references.drop(name)
        remove_adapter(self.base.model, name)
        self.meter.refresh_weights()
        return job

    def hold_reference(self, job: TrainingJob, load: Callable[[AdapterHandle], object]) -> None:
        """The job's reference model is a frozen adapter of its shape whose weights `load` gives (its init_adapter:
        `JobSpec.reference_adapter`), held until the job leaves (actors/engine/job_references.py)."""
        self.references.hold(job.spec, job.seed, load)
        self.meter.refresh_weights()

    @property
    def active_jobs(self) -> list[TrainingJob]:
        return [job for job in self.jobs.values() if not job.done]

    # -- a step's GRPO completions ----------------------------------------------------------------
    def rollouts(self, chosen: list[tuple[TrainingJob, list[Example]]]
                 ) -> tuple[list[tuple[TrainingJob, list]], list[tuple[TrainingJob, Exception]]]:
        """The chosen micro-batches with each GRPO job's prompts expanded into sampled, scored completions, and the
        GRPO jobs whose reward or sampling failed, to be failed by the caller (`grpo.step_rollouts`)."""
        return step_rollouts(self.base, chosen, self.functions)

    # -- running a step ---------------------------------------------------------------------------
    def run_step(self, chosen: list[tuple[TrainingJob, list[Example]]], *, measure: bool = False,
                 meanwhile: Callable[[], None] | None = None, calls: FusedCalls | None = None) -> StepReport:
        """One fused forward/backward over the chosen jobs' micro-batches, then their optimizer steps.
        `measure` (CPU): the step's peak is counted from the allocator's events (torch.profiler, slower:
        `memory.measure_peak`) over the bytes held before it, instead of estimated. `meanwhile`: the host's
        other work, done once the step's kernels are queued and before its read-back, while the device runs
        them (the service's messages about the last step); it must not raise. `calls`: interactive models'
        forward_backward calls (checked: `check_call`) that share the step, after the jobs' tokens in its
        stream (`fuses_calls`): their gradients join their adapters', their outputs are the report's
        `call_outputs`."""
        if self.resident_measured:
            reset_peak_resident()   # the step's own peak, not one a job's export or start left between steps
        if not measure or self.base.device.type == "cuda":
            report = self._run_step(chosen, meanwhile, calls)
        else:
            held = live_tensor_bytes(self.base.model, [job.optimizer.optimizer for job in self.jobs.values()])
            report, growth = measure_peak(lambda: self._run_step(chosen, meanwhile, calls), self.base.device)
            report.peak_memory_bytes = held + growth
            report.memory_measured = True
        if self.resident_measured:
            report.resident_peak_bytes = peak_resident_bytes()
        if report.replayed:   # its activations lie in its graph's pool: its peak teaches the memory model nothing
            report.memory_measured = False
        return report

    held_adapters = None   # a finished job's adapter is tried on this device's base itself (try_adapter.py)

    @property
    def fuses_calls(self) -> bool:
        """Whether interactive calls can share this trainer's steps: a packed stream, not compiled (a padded
        layout or a compiled bucket has no place for them)."""
        return self.layout == "packed" and (self.compiled is None or self.graphs is not None)

    def _run_step(self, chosen: list[tuple[TrainingJob, list[Example]]],
                  meanwhile: Callable[[], None] | None = None, calls: FusedCalls | None = None) -> StepReport:
        """The step as the device runs it. Nothing inside waits for the device but the one read-back: the batch
        goes over in one copy from pinned memory, losses and norms stay on the device until the read-back, which
        comes once every kernel of the step up to the optimizers' norms is queued; meanwhile the next step's batch
        is packed and sent (`_prepack_next`); the optimizers' updates are launched after it."""
        started = time.perf_counter()
        micro_batches = [JobMicroBatch(job.name, batch) for job, batch in chosen]
        block = call_part = None
        graphed = (self.compiled.run(chosen, micro_batches, calls, self.meter)
                   if isinstance(self.compiled, GraphedSteps) else None)
        replayed = False
        if graphed is not None:
            batch, objective, tokens, padding, loss_rows, replayed = graphed
        else:
            batch, objective, block, call_part = self._forward_backward(chosen, micro_batches, calls)
            tokens, padding, loss_rows = batch.num_tokens, batch.padding_tokens, int(batch.target_ids.numel())
        head = self.base.lm_head
        stepping = {job.name for job, _ in chosen}   # and the jobs whose gradient buffers stay between steps
        gradient_bytes = sum(job.optimizer.gradient_bytes() for job in self.jobs.values()
                             if job.name in stepping or job.adapter.held_gradient_bytes())
        optimizer_bytes = sum(job.optimizer.state_bytes() for job in self.jobs.values())
        peak = self.meter.peak_bytes(gradient_bytes=gradient_bytes, optimizer_bytes=optimizer_bytes,
                                     transient_bytes=logits_transient_bytes(
                                         self.loss_chunk, head.weight.shape[0], loss_rows,
                                         softcapped=self.base.logit_transform.softcap is not None,
                                         fused=fused_loss(head.weight), element_bytes=head.weight.element_size()))
        counts, metrics = objective.counts, objective.metrics
        for index, (job, rows) in enumerate(chosen):   # a generation's micro-batch, kept to replay (num_iterations)
            if job.replay is not None and not job.replaying:
                job.replay.record(rows, objective.completion_logps[index])
        due = [job for index, (job, _) in enumerate(chosen)
               if job.count_micro_batch(batch.job_tokens[index], counts[index])]
        # the due jobs' optimizer steps together: a few multi-tensor operations whatever their number; on CUDA
        # their updates launched only after the read-back below, which then waits for the backward and the norms,
        # not the updates: the device runs those while the host returns and composes the next step
        updates: list[Callable[[], None]] = []
        stepped = step_jobs([job.optimizer for job in due], [job.accumulator.targets for job in due],
                            on_device=self.base.device.type == "cuda", later=updates)
        self._prepack_next()
        if meanwhile is not None:
            meanwhile()
        per_job, norms = _read_back(objective.job_losses, [norm for _, norm in stepped])   # the step's one wait
        for update in updates:
            update()
        call_outputs = call_part.outputs() if block is not None else []
        for index, (job, _) in enumerate(chosen):
            job.accumulator.add_loss(per_job[index], counts[index], metrics[index])
        records = {job.name: job.optimizer_stepped(lr, norm)
                   for job, (lr, _), norm in zip(due, stepped, norms, strict=True)}
        results = [JobStepResult(job=job.name, loss=per_job[index], tokens=batch.job_tokens[index],
                                 targets=batch.job_targets[index], optimizer_step=records.get(job.name))
                   for index, (job, _) in enumerate(chosen)]
        self.step_count += 1
        return StepReport(step=self.step_count, jobs=batch.jobs, tokens=tokens,
                          padding_tokens=padding, seconds=time.perf_counter() - started,
                          peak_memory_bytes=peak, sequence_lengths=batch.sequence_lengths, results=results,
                          memory_measured=self.base.device.type == "cuda", replayed=replayed,
                          call_outputs=call_outputs,
                          call_tokens=len(block.ids) if block is not None else 0)

    def _forward_backward(self, chosen: list[tuple[TrainingJob, list[Example]]], micro_batches: list[JobMicroBatch],
                          calls: FusedCalls | None) -> tuple:
        """The eager step's forward, loss and backward: (its batch on the device, its objective, the calls' block in
        its stream or None, the calls' part of the loss or None)."""
        block = call_part = None
        if calls:
            if not self.fuses_calls:
                raise ValueError(f"interactive calls cannot share a step of layout '{self.layout}' or a compiled "
                                 "one: run them in a pass of their own")
            self.batches.drop()   # the next step was guessed without these calls
            batch, block = with_calls(pack(micro_batches, self.layout, self.base.pad_token_id), calls.calls)
            batch = batch.to(self.base.device)
        else:
            batch = self.batches.for_step(micro_batches)
        layers = self.compiled if self.graphs is None else None   # compile: default's (a graphed step is not here)
        compiled = layers.active() if layers is not None else contextlib.nullcontext()
        references = self.references.for_step([job for job, _ in chosen], micro_batches, self.loss_chunk)
        olds = {index: job.replay.old_logps(rows) for index, (job, rows) in enumerate(chosen) if job.replaying}
        model = self.base.model
        set_adapters_training(model, True)
        with self.meter.forward():
            with step_layout(batch.layout), recomputed_layers(self.base.decoder, self.recompute), compiled:
                hidden = self.base.decoder(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                                           attention_mask=None, use_cache=False).last_hidden_state[0]
            objective = step_objective(self.base, batch, hidden,
                                       [ObjectiveJob(job.spec, job.optimizer.token_weight) for job, _ in chosen],
                                       micro_batches, references, self.loss_chunk, olds)
            total = objective.total
            if block is not None:   # the calls' tokens: the stream's last block
                call_part = call_losses(self.base, hidden[batch.num_tokens - len(block.ids):], calls.calls,
                                        calls.configs, block.targets.to(hidden.device))
                total = total + call_part.total
        total.backward()
        return batch, objective, block, call_part

    @property
    def graphs(self) -> StepGraphs | None:
        """`compile: graphs`' captured steps (actors/engine/step_graphs.py), else None."""
        return self.compiled.graphs if isinstance(self.compiled, GraphedSteps) else None

    def _prepack_next(self) -> None:
        """On CUDA, while the step's kernels run: pack the step most likely to come next (every active job's
        next micro-batch, where they fit one step together and each is at hand without waiting) and send it,
        so that the next step starts as soon as this one is read back. A step composed otherwise (a composer,
        a memory budget, jobs that joined or left) packs its own; GRPO and preference jobs' steps are not
        guessed (their rows are made or looked up per step). With `compile: graphs`, the next step's fixed batch is
        made on the host (its copy into the graph's inputs waits for the step: they are the graph's)."""
        if not self.batches.ahead or self.composer is not None:
            return
        jobs = self.active_jobs
        if not jobs or any(job.spec.method != "sft" for job in jobs) or not all(j.next_batch_ready() for j in jobs):
            return
        micro = [JobMicroBatch(job.name, batch) for job in jobs if (batch := job.peek()) is not None]
        if not micro or (len(micro) > 1 and self.composition.step_cost(micro) > self.step_tokens):
            return
        if isinstance(self.compiled, GraphedSteps):
            self.compiled.send_ahead([self.jobs[mb.job] for mb in micro], micro)
        else:
            self.batches.send_ahead(micro)

    def train_step(self) -> StepReport | None:
        """Compose the next step, expand its GRPO jobs' rollouts (a failed reward raises), run it."""
        chosen = self.compose()
        if not chosen:
            return None
        chosen, failed = self.rollouts(chosen)
        if failed:
            raise failed[0][1]
        return self.run_step(chosen)

    # -- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, job: TrainingJob, examples: list[Example] | None = None, batch_size: int = 8) -> float:
        """Mean loss over the target tokens of `examples` (default: the job's eval split); for a preference
        job, the mean of its DPO / ORPO loss over the pairs."""
        examples = job.eval_examples if examples is None else examples
        if not examples:
            raise ValueError(f"job '{job.name}' has no eval examples (set eval_split)")
        set_adapters_training(self.base.model, False)
        try:
            if job.spec.method in PREFERENCE_METHODS:   # the mean of its preference loss over the eval pairs
                return evaluate_preference(self.base, job.name, job.spec.method, job.spec.preference.beta,
                                           examples, batch_size, self.loss_chunk,
                                           self.references.cache(job.name),
                                           cpo_alpha=job.spec.preference.cpo_alpha,
                                           reference_adapter=self.references.name_of(job.name))
            return mean_loss(self.base, job.name, examples, batch_size, self.loss_chunk)
        finally:
            set_adapters_training(self.base.model, True)

    def decode(self, requests: list, choose: Callable, finished: Callable) -> None:
        """`generate.decode` on this trainer's base (each row through its job's adapter, or the base alone)."""
        decode(self.base, requests, choose, finished)

    def evaluate_generation(self, jobs: list[TrainingJob]) -> list[GenerationEvaluation]:
        """Each job's `eval_generate` score over its eval rows, with the rows it scored
        (actors/engine/generation_eval.py), all jobs' rows decoded in one batch through their own adapters."""
        return generation_evaluations(self.base, generation_jobs(jobs), self.functions)

    @torch.no_grad()
    def rebuild(self) -> None:
        """Nothing to rebuild: one device has no stages to lose."""

    def close(self) -> None:
        """The users' functions' process stopped (the base stays loaded with its process)."""
        self.functions.close()

    def logits(self, adapter: str, input_ids: torch.Tensor) -> torch.Tensor:
        """Full logits of one adapter on a (batch, length) tensor of unpadded equal-length rows (the model's
        own forward: its logit transform included)."""
        return adapter_logits(self.base, adapter, input_ids)


def _read_back(losses: torch.Tensor, norms: list[float | torch.Tensor]) -> tuple[list[float], list[float]]:
    """The step's per-job losses and the optimizers' norms as floats, in one read (on CUDA: one wait, after the
    whole step is queued)."""
    on_device = [index for index, norm in enumerate(norms) if isinstance(norm, torch.Tensor)]
    if not on_device:
        return losses.tolist(), [float(norm) for norm in norms]
    values = torch.cat([losses.to(torch.float64), torch.stack([norms[i] for i in on_device]).to(torch.float64)])
    values = values.tolist()
    read = list(norms)
    for position, index in enumerate(on_device):
        read[index] = values[len(losses) + position]
    return values[:len(losses)], [float(norm) for norm in read]
