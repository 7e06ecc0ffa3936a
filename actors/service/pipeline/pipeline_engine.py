"""A pipeline trainer behind the calls the trainer loop makes of the single-device `FusedTrainer` (attach,
add, compose, run a step, evaluate, remove), so that `stages: N` runs through the same loop: the same data
feeds, stop rules, evaluations, checkpoints and adapters as one device.

One loop step on a pipeline is one optimizer step of every job the loop found ready: the head composes their
micro-batches (a job's whole accumulation, several jobs per micro-batch, every stage busy while any job has
work) and the step ends when every one of those steps is booked. Between loop steps nothing is in flight, so
the loop's verdicts, checkpoints, pauses and cancellations see each job at a step boundary, as on one device.
The price is one pipeline fill and drain per loop step, made smaller by spreading the step's jobs over more,
smaller micro-batches (`PLANS_PER_STAGE`; bench/pipeline.py's loop column against the engine left running).

Each job also has a mirror on this process's CPU, so that checkpoints and adapters are written and read by
the same code, in the same format, as on one device (`PipelineJob`: pipeline_job.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from actors.checkpoint.initial_adapter import start_from_adapter
from actors.data import Example
from actors.engine.adapter_surgery import AdapterHandle, linear_module_names
from actors.engine.generation_eval import GenerationEvaluation, generation_evaluations, generation_jobs
from actors.engine.grpo import rollout_seed, rollouts, sampling_bytes, sampling_memory_error
from actors.engine.grpo_rewards import RewardError
from actors.engine.job import BatchSource
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch
from actors.engine.pipeline.head import PipelineTrainer
from actors.engine.pipeline.stage_generation import HeldAdapter
from actors.engine.pipeline.stage_loading import StageLoader
from actors.engine.pipeline.stage_memory import StageMemory
from actors.engine.pipeline.stage_messages import StageSettings
from actors.engine.preference import reference_adapter_name
from actors.engine.step_report import JobStepResult, StepReport
from actors.engine.user_calls import FunctionWorker
from actors.service.pipeline.pipeline_job import PipelineJob, mirror_adapter
from actors.service.pipeline.pipeline_processes import LocalPipeline, StageLost, StageStarter
from actors.spec.job_spec import JobSpec
from actors.spec.saved_adapter import read_back_form
from actors.spec.trainer_settings import step_tokens_floor
from actors.storage.storage_uri import StorageURI

if TYPE_CHECKING:
    from actors.service.scheduler.config import TrainerConfig


# micro-batches per stage a loop step's jobs are spread over (`PipelineTrainer.plans_per_stage`): the stages
# fill and drain once per loop step, which costs less the more micro-batches the step has (bench/pipeline.py's
# loop column, 4 and 8 jobs on 2 CPU stages: 0.75-0.78x the tokens/s of the pipeline left running with 1,
# 0.91-0.93x with 4); smaller micro-batches fuse fewer jobs, which a GPU would rather not, hence not more
PLANS_PER_STAGE = 4


class PipelineEngine:
    """The trainer loop's trainer for `stages: N` (see the module's docstring). `pipeline`: the running
    stages (`LocalPipeline`); closing the engine stops them."""

    recompute = "none"
    layout = "packed"   # a pipeline packs its micro-batches (the only layout its stages run)

    def __init__(self, launch: Callable[[], LocalPipeline], *, step_tokens: int, layout: str = "packed",
                 on_close: Callable[[], None] | None = None):
        """`launch`: starts the stages (again after one was lost: `rebuild`); `on_close`: after `close`."""
        if layout != "packed":
            raise ValueError(f"a pipeline trainer packs its micro-batches; layout '{layout}' is for one device")
        self.launch = launch
        self.on_close = on_close
        self.pipeline = launch()
        self.head: PipelineTrainer = self.pipeline.trainer
        self.head.plans_per_stage = PLANS_PER_STAGE
        self.step_tokens = step_tokens
        self.functions = FunctionWorker()   # users' eval_generate metrics: a process of their own, started if asked
        self.jobs: dict[str, PipelineJob] = {}
        self.step_count = 0
        self.rotation = 0
        self.last_peaks: list[int] = []      # each stage's measured peak in the last measured step
        self.lost: StageLost | None = None   # the stage lost, until `rebuild`
        self.module_order = linear_module_names(self.base.model)

    def _guarded(self, call: Callable, *args, **kwargs):
        """A call to the stages; after a stage was lost, every call raises that until `rebuild`."""
        if self.lost is not None:
            raise self.lost
        try:
            return call(*args, **kwargs)
        except StageLost as error:
            self.lost = error
            raise

    def rebuild(self) -> None:
        """New stages for the lost ones: the old processes stopped, every job dropped (each resumes from its
        last checkpoint when assigned again)."""
        window = self.head.runtime.measures.window
        if window.open:   # stage 0's, in this process: left open by the step that lost the stage
            window.stop()
        self.pipeline.close(failed=True)
        self.jobs.clear()
        self.pipeline = self.launch()
        self.head = self.pipeline.trainer
        self.head.plans_per_stage = PLANS_PER_STAGE
        self.lost = None

    @property
    def base(self) -> BaseModel:
        """Stage 0's share of the base (its name, tokenizer, dtype and device are the base's)."""
        return self.head.runtime.model.base

    @property
    def stages(self) -> int:
        return self.head.stages

    def peft_targets(self, name: str) -> list[str]:
        return self.head.runtime.jobs[name].adapter.peft_targets

    # -- jobs -----------------------------------------------------------------------------------------
    def attach(self, spec: JobSpec, source: BatchSource, eval_examples: list[Example], total_steps: int, *,
               seed: int) -> PipelineJob:
        """The job on every stage, its adapter initialised as on one device; not yet in the steps (`add_job`)."""
        if spec.lora.kind == "vera":
            raise ValueError(f"job '{spec.name}': lora.kind: vera is not available on a pipeline trainer yet (its "
                             "stages would each hold a share of the shared projections); run the job on a "
                             "single-device trainer, or use kind: lora")
        self._guarded(self.pipeline.add_job, spec, cursor=source, total_steps=total_steps, seed=seed,
                      eval_examples=eval_examples)
        head = self.head.jobs[spec.name]
        head.step_limit = 0
        return PipelineJob(self, head, list(eval_examples), seed)

    def restored(self, job: PipelineJob) -> None:
        """A checkpoint was loaded into the job's mirror: the stages take it, the head its counters."""
        self._set_up_again(job, job.mirror_state(), job.head.reference)

    def _set_up_again(self, job: PipelineJob, state: dict, reference: dict | None) -> None:
        """The job on every stage again, from `state` (its mirror's), with its reference adapter's tensors."""
        replay = job.head.replay   # the head's alone (its generation, replayed; a checkpoint's where loaded)
        self._guarded(self.pipeline.remove_job, job.name)
        self._guarded(self.pipeline.add_job, job.spec, cursor=job.head.cursor, total_steps=job.total_steps,
                      seed=job.seed, eval_examples=job.eval_examples, state=state, reference=reference)
        job.head = self.head.jobs[job.name]
        job.head.replay = replay
        job.head.step_limit = 0
        job.stale = True

    def hold_reference(self, job: PipelineJob, load: Callable[[AdapterHandle], object]) -> None:
        """The job's reference model, a frozen adapter of its shape whose weights `load` gives (its init_adapter:
        `JobSpec.reference_adapter`): loaded into a CPU copy of its adapter here, then every stage takes its share
        (the job set up again on the stages with its state as it is)."""
        state = job.mirror_state()
        copy = mirror_adapter(reference_adapter_name(job.name), job.spec, {"tensors": state["tensors"]},
                              self.module_order, job.adapter.peft_targets)
        load(copy)
        self._set_up_again(job, state, {key: parameter.detach().clone() for key, parameter in copy.named_parameters()})

    def add_job(self, job: PipelineJob) -> None:
        if job.name in self.jobs:
            raise ValueError(f"job '{job.name}' is already on this trainer")
        self.jobs[job.name] = job

    def discard(self, name: str) -> None:
        """Take a job that could not start off every stage (after a lost stage: off this engine only)."""
        self.jobs.pop(name, None)
        if name in self.head.jobs and self.lost is None:
            self._guarded(self.pipeline.remove_job, name)

    def remove_job(self, name: str) -> PipelineJob:
        """Off every stage (after a lost stage: off this engine only; `rebuild` drops the rest)."""
        job = self.jobs.pop(name)
        if self.lost is None:
            self._guarded(self.pipeline.remove_job, name)
        return job

    # -- steps ----------------------------------------------------------------------------------------
    def compose(self, jobs: list[PipelineJob],
                fits: Callable[[list[JobMicroBatch]], bool] | None = None) -> list[tuple[PipelineJob, list[Example]]]:
        """Which ready jobs take part in the next loop step (the head packs their micro-batches itself):
        round-robin from where the last step left off, each while `fits` allows (every stage's memory); the
        first always joins."""
        candidates = [job for job in jobs if job.name in self.jobs and job.peek() is not None]
        if not candidates:
            return []
        start = self.rotation % len(candidates)
        self.rotation += 1
        chosen: list[tuple[PipelineJob, list[Example]]] = []
        for job in candidates[start:] + candidates[:start]:
            trial = [JobMicroBatch(job=j.name, examples=b) for j, b in chosen]
            trial.append(JobMicroBatch(job=job.name, examples=job.peek()))
            if chosen and fits is not None and not fits(trial):
                continue
            chosen.append((job, job.peek()))
        return chosen

    def step_cost(self, micro_batches: list[JobMicroBatch]) -> int:
        return sum(len(example) for micro_batch in micro_batches for example in micro_batch.rows)

    def run_step(self, chosen: list[tuple[PipelineJob, list[Example]]], *, measure: bool = False,
                 meanwhile: Callable[[], None] | None = None, calls: object = None) -> StepReport:
        """One optimizer step of each chosen job through the stages, every one booked at the end; `meanwhile`
        (the host's other work) once they are, after the stages' step. No interactive calls (`fuses_calls`)."""
        if calls:
            raise ValueError("a pipeline trainer runs no interactive calls")
        started = time.perf_counter()
        names = {job.name for job, _ in chosen}
        before = {name: len(self.head.jobs[name].history) for name in names}
        for name, head in self.head.jobs.items():
            head.step_limit = head.planned_steps + 1 if name in names else head.planned_steps
        if measure:
            self._guarded(self.pipeline.measure, True)
        try:
            plans = self._guarded(self.pipeline.run)
        finally:
            for head in self.head.jobs.values():
                head.step_limit = head.planned_steps
        self.last_peaks = [int(peak) for peak in self._guarded(self.pipeline.measure, False)] if measure else []
        results = []
        for job, _ in chosen:
            job.stale = True
            for record in job.history[before[job.name]:]:
                results.append(JobStepResult(job=job.name, loss=record.loss, tokens=record.tokens, targets=0,
                                             optimizer_step=record))
        self.step_count += 1
        if meanwhile is not None:
            meanwhile()
        return StepReport(step=self.step_count, jobs=sorted(names), tokens=sum(p.tokens for p in plans),
                          padding_tokens=sum(p.padding_tokens for p in plans),
                          seconds=time.perf_counter() - started, peak_memory_bytes=max(self.last_peaks, default=0),
                          results=results, memory_measured=bool(self.last_peaks))

    def evaluate(self, job: PipelineJob, examples: list[Example] | None = None, batch_size: int = 8) -> float:
        return self._guarded(self.pipeline.evaluate, job.name, examples, batch_size)

    def stats(self) -> list[dict]:
        return self._guarded(self.pipeline.stats)

    def memory(self) -> list[StageMemory]:
        """Each stage's memory model (pipeline_admission.py), its held bytes as of now."""
        return self._guarded(self.pipeline.memory)

    fuses_calls = False   # interactive models live on one-device trainers only

    @property
    def held_adapters(self) -> PipelineEngine:
        """Its stages hold a finished job's adapter for a "try it" call (`hold_saved`, `drop_held`)."""
        return self
    generation_refusal = None   # it decodes over its stages (actors/engine/pipeline/stage_generation.py)

    def decode(self, requests: list, choose: Callable, finished: Callable) -> None:
        """`generate.decode` over the stages: each row through its adapter (a job's name, or None for the base)."""
        self._guarded(self.pipeline.generate, requests, choose, finished)

    def hold_saved(self, name: str, spec: JobSpec, location: str | Path | StorageURI) -> None:
        """The adapter a finished job (`spec`) saved at `location`, held frozen on every stage under `name` for
        decoding calls until `drop_held`: each stage adds its share, the whole is read and checked here into a CPU
        copy (`start_from_adapter`, as on one device), then every stage takes its values. AdapterFileError, nothing
        held, where it cannot be read or does not fit."""
        lora = read_back_form(spec.lora)   # as it was saved (PiSSA / OLoRA: their conversion to a plain LoRA)
        shares = self._guarded(self.pipeline.hold, HeldAdapter(name, lora=lora))
        try:
            tensors = {key: value for share in shares for key, value in share.items()}
            copy = mirror_adapter(name, spec.model_copy(update={"lora": lora}), {"tensors": tensors},
                                  self.module_order, self.head.runtime.evaluator.generation.held[name].peft_targets)
            start_from_adapter(copy, location)
            values = {key: parameter.detach().clone() for key, parameter in copy.named_parameters()}
            for module, a0, b0 in copy.frozen_initial():
                values[f"{module}.lora_A0"], values[f"{module}.lora_B0"] = a0.clone(), b0.clone()
            self._guarded(self.pipeline.hold, HeldAdapter(name, tensors=values))
        except BaseException:
            if self.lost is None:
                self.drop_held(name)
            raise

    def drop_held(self, name: str) -> None:
        """Every stage lets go of an adapter `hold_saved` held."""
        self._guarded(self.pipeline.hold, HeldAdapter(name))

    def sampling_bytes(self, stage: int, rows: int, width: int) -> int:
        """What decoding `rows` sequences of up to `width` tokens needs at `stage` beyond what it holds
        (`grpo.sampling_bytes` of its layers; the logits at the last stage, which computes them, and at stage 0,
        which chooses from them)."""
        return sampling_bytes(self.base, rows, width, layers=self.pipeline.split[stage],
                              logits=stage in (0, self.stages - 1))

    def rollouts(self, chosen: list[tuple[PipelineJob, list[Example]]]
                 ) -> tuple[list[tuple[PipelineJob, list]], list[tuple[PipelineJob, Exception]]]:
        """The chosen micro-batches with each GRPO job's prompts expanded into sampled, scored completions, as
        `FusedTrainer.rollouts` (the same seeds), sampled over the stages; the head composes the job's step from
        them. A loop step on a pipeline is a whole optimizer step, so a job with `grad_accum` > 1 has the rest of
        its accumulation's micro-batches read and sampled now too, each with the seed one device gives it (its
        adapter does not change within an accumulation, so they are the completions one device samples one loop
        step at a time). The GRPO jobs whose reward failed, whose rows have no prompt or whose sampling ran out of
        memory, to be failed by the caller."""
        kept: list[tuple[PipelineJob, list]] = []
        failed: list[tuple[PipelineJob, Exception]] = []
        for job, batch in chosen:
            head = self.head.jobs[job.name]
            if job.spec.grpo is None or head.replaying:   # a replayed micro-batch is its generation's rollouts
                kept.append((job, batch))
                continue
            raw = [batch] + self._rest_of_accumulation(job)
            expanded: list[list] = []
            for ahead, rows in enumerate(raw):
                try:
                    expanded.append(rollouts(self.base, job.name, job.spec.grpo, rows, rollout_seed(job, ahead),
                                             self.functions, decoder=self.decode))
                except (RewardError, ValueError) as error:
                    failed.append((job, error))
                    break
                except torch.OutOfMemoryError as error:   # its sampling alone (stage 0's): the others' step goes on
                    failed.append((job, sampling_memory_error(self.base, job.spec.grpo, rows, error)))
                    break
            else:
                head.pending, head.prepared = expanded[0], expanded[1:]   # what the head composes the step from
                kept.append((job, expanded[0]))
        return kept, failed

    def _rest_of_accumulation(self, job: PipelineJob) -> list[list[Example]]:
        """The micro-batches after the peeked one that close the job's current accumulation, read from its data
        (fewer where the data ends first, as the head closes an accumulation there)."""
        rest = []
        for _ in range(job.spec.grad_accum - job.accumulator.micro_batches - 1):
            rows = job.head.cursor.next_batch()
            if rows is None:
                break
            rest.append(rows)
        return rest

    def evaluate_generation(self, jobs: list[PipelineJob]) -> list[GenerationEvaluation]:
        """Each job's `eval_generate` score over its eval rows, as `FusedTrainer.evaluate_generation`, the rows
        decoded over the stages; stage 0's base gives the tokenizer and the stop tokens."""
        return generation_evaluations(self.base, generation_jobs(jobs), self.functions, decoder=self.decode)

    def close(self) -> None:
        try:
            self.pipeline.close(failed=self.lost is not None)
        finally:
            self.functions.close()
            if self.on_close is not None:
                self.on_close()


def start_pipeline(config: TrainerConfig, loader: Callable[[], BaseModel] | None = None, *,
                   threads: int | None = None, starter: StageStarter | None = None, address: str = "127.0.0.1",
                   on_close: Callable[[], None] | None = None) -> PipelineEngine:
    """The stages of a `stages: N` trainer, stage 0 in this process. Without a `starter`, the others are
    processes of this one, each on its device: one GPU each where this machine has as many, all on its first
    GPU otherwise (their activations then pass by CUDA IPC), or the CPU. With one (Ray's stage actors, which
    meet stage 0 at `address`), each stage sees its own GPU. `loader`: the base (default:
    `config.base_model`, each stage reading only its own tensors); `threads`: torch threads per stage;
    `on_close`: called once the stages stopped (e.g. to free their placement group)."""
    stages = config.stages
    if config.num_gpus == 0:
        devices, transport = ["cpu"] * stages, "distributed"
    elif starter is not None:
        devices, transport = ["cuda:0"] * stages, "distributed"
    elif torch.cuda.device_count() >= stages:
        devices, transport = [f"cuda:{index}" for index in range(stages)], "distributed"
    else:
        devices, transport = ["cuda:0"] * stages, "shared"
    settings = StageSettings(layout=config.layout, recompute=config.recompute)
    split = config.stage_split if isinstance(config.stage_split, str) else list(config.stage_split)
    loader = loader or StageLoader(base_model=config.base_model, dtype=config.dtype)

    chosen: dict[str, Any] = {"split": split}

    def launch() -> LocalPipeline:   # a rebuilt pipeline keeps the first one's split (none measured again)
        pipeline = LocalPipeline(loader, stages, split=chosen["split"], devices=devices, settings=settings,
                                 step_tokens=step_tokens_floor(config.step_tokens), threads=threads,
                                 transport=transport, starter=starter, address=address)
        chosen["split"] = list(pipeline.split)
        return pipeline
    return PipelineEngine(launch, step_tokens=step_tokens_floor(config.step_tokens), layout=config.layout,
                          on_close=on_close)
