"""The pipeline trainer's head: the jobs as the trainer sees them (data cursors, accumulation, history), the
composer of micro-batches, and the stream of messages every stage runs from. It lives in stage 0's process.

Composing needs no result from the stages: which micro-batch closes a job's accumulation is known when it
is composed (every `grad_accum`-th, or the last of the data). So the head composes whenever the schedule
wants a plan, sends it to every stage and runs stage 0's operations; losses and gradient norms come back as
the operations run and are booked in plan order. A plan takes up to ⌈jobs / stages⌉ jobs that would not
wait (their step done), within `step_tokens`, so that with enough jobs every stage has work (`share`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from actors.data import DataCursor, Example
from actors.engine.grpo_replay import GrpoReplay
from actors.engine.job import BatchSource, OptimizerStepRecord
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.pipeline.head_jobs import HeadJob
from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan
from actors.engine.pipeline.plan_book import PlanBook, PlanReport
from actors.engine.pipeline.stage import StageRuntime
from actors.engine.pipeline.stage_generation import stage_requests
from actors.engine.pipeline.stage_messages import EvalRequest, JobSetup, PlanMessage, StageMessageKind
from actors.engine.pipeline.transport import TAG_COMMAND, TAG_REPLY, StageLinks
from actors.engine.preference import ReferenceCache
from actors.spec.job_spec import JobSpec, cursor_epochs, planned_steps
from actors.spec.method_config import PREFERENCE_METHODS


class PipelineTrainer:
    """Stage 0's process: `add_job`, `run`, `job_state`, `remove_job`, `close` (the other stages stop)."""

    def __init__(self, runtime: StageRuntime, links: StageLinks, *, step_tokens: int = 4096):
        if runtime.stage != 0:
            raise ValueError("the pipeline head runs in stage 0's process")
        self.runtime = runtime
        self.links = links
        self.stages = runtime.stages
        self.step_tokens = step_tokens
        self.layout = runtime.settings.layout
        self.jobs: dict[str, HeadJob] = {}
        self.book = PlanBook(self.jobs, runtime.norms.for_head)   # the plans sent, their results booked in order
        self.rotation = 0
        self.reference_caches: dict[str, ReferenceCache] = {}   # which DPO pairs the last stage holds
        # micro-batches per stage that take each composable job once: 1 keeps them large (the pipeline runs
        # on, one fill for the whole run); more make them smaller where the pipeline drains often (once per
        # trainer loop step: actors/service/pipeline/pipeline_engine.py), so that its fill costs less
        self.plans_per_stage = 1
        self.replies: list[dict] = []
        runtime.on_result = self.book.on_result

    # -- messages to every stage -------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        for stage in range(1, self.stages):
            self.links.send_object(message, stage, TAG_COMMAND)
        replies = self.runtime.handle(message)
        if replies:
            self.replies.extend(replies)
        self.book.book()

    def close(self) -> None:
        for stage in range(1, self.stages):
            self.links.send_object((StageMessageKind.STOP,), stage, TAG_COMMAND)
        self.links.flush()

    # -- jobs --------------------------------------------------------------------------------------
    def add_job(self, spec: JobSpec, train: list[Example] | None = None, *, seed: int,
                cursor: BatchSource | None = None, total_steps: int | None = None, state: dict | None = None,
                eval_examples: list[Example] | None = None, reference: dict | None = None) -> None:
        """A job from its examples (or a `cursor` and its `total_steps`), optionally resumed from `state`
        (`job_state` of an earlier run: adapter, optimizer moments and counters, data position); `reference`: the
        tensors of its frozen reference adapter by parameter name (its init_adapter: `JobSpec.reference_adapter`)."""
        if spec.name in self.jobs:
            raise ValueError(f"job '{spec.name}' is already on this pipeline")
        if self.runtime.model.base.dtype == torch.float16:
            raise ValueError("a pipeline trainer trains bfloat16 or float32 bases: float16's per-job loss scaling "
                             "over stages is not implemented; load the base in bfloat16")
        if cursor is None:
            if train is None:
                raise ValueError("add_job needs the job's examples or a cursor")
            cursor = DataCursor(train, spec.batch_size, seed=seed, epochs=cursor_epochs(spec))
            total_steps = planned_steps(spec, len(train))
        job = HeadJob(spec=spec, cursor=cursor, total_steps=int(total_steps), seed=seed,
                      eval_examples=list(eval_examples or []), reference=reference)
        if spec.grpo is not None and spec.grpo.num_iterations > 1:
            job.replay = GrpoReplay(spec.grpo.num_iterations)
        if state is not None:
            job.cursor.load_state_dict(state["data_position"])
            job.planned_steps = state["step_count"]
            job.micro_count = state["micro_count"]
            job.history = [OptimizerStepRecord(**row) for row in state.get("history", [])]
            job.tokens_seen = state.get("tokens_seen", 0)
            if state.get("accumulator") is not None:   # resumed mid-accumulation (its gradients in `state`)
                job.accumulator = state["accumulator"]
                job.step_targets = job.accumulator.targets
        self.jobs[spec.name] = job
        self._send((StageMessageKind.ADD_JOB, JobSetup(spec=spec, seed=seed, total_steps=job.total_steps, state=state,
                                                       reference=reference)))

    def job_state(self, name: str) -> dict:
        """The job's whole state once its planned work is done: adapter tensors and optimizer moments by
        parameter name (gathered from every stage), counters, data position, history."""
        self._send((StageMessageKind.READ_JOB, name))
        return self._state_reply(name)

    def remove_job(self, name: str) -> dict:
        """Stop planning the job, let its micro-batches in flight end, take its state, detach it everywhere."""
        state = self.job_state(name)
        self._send((StageMessageKind.REMOVE_JOB, name))
        del self.jobs[name]
        self.reference_caches.pop(name, None)
        return state

    def _state_reply(self, name: str) -> dict:
        while not any(reply["job"] == name for reply in self.replies):
            self._send((StageMessageKind.DRAIN,))
        reply = next(reply for reply in self.replies if reply["job"] == name)
        self.replies.remove(reply)
        job = self.jobs[name]
        state = reply["state"]
        state["step_count"], state["micro_count"] = job.planned_steps, job.micro_count
        state["data_position"] = job.data_position()
        state["history"] = [dataclasses.asdict(record) for record in job.history]
        state["tokens_seen"] = job.tokens_seen
        return state

    # -- running -----------------------------------------------------------------------------------
    def run(self, max_plans: int | None = None, *, until: Callable[[], bool] | None = None) -> list[PlanReport]:
        """Compose and run micro-batches while any job has data (at most `max_plans`, or until `until()`),
        then let everything in flight finish. Returns the reports of the plans booked meanwhile."""
        start = len(self.book.reports)
        composed = 0
        while max_plans is None or composed < max_plans:
            if until is not None and until():
                break
            if not self.runtime.schedule.wants_plan:
                raise RuntimeError("pipeline schedule stalled: it wants no plan but has nothing to run")
            message = self._compose()
            if message is None:
                break
            self._send((StageMessageKind.PLAN, message))
            composed += 1
        self._send((StageMessageKind.DRAIN,))
        return self.book.reports[start:]

    def stats(self) -> list[dict]:
        """Each stage's busy time, span and bubble share (idle share of its span)."""
        return self.ask((StageMessageKind.STATS,))

    def ask(self, message: tuple) -> list:
        """Every stage's answer to `message` (stats, memory, measure), stage 0's first; nothing in flight."""
        for stage in range(1, self.stages):
            self.links.send_object(message, stage, TAG_COMMAND)
        out = [self.runtime.handle(message)]
        return out + [self.links.recv_object(stage, TAG_REPLY) for stage in range(1, self.stages)]

    def share(self, jobs: int) -> int:
        """How many of `jobs` composable jobs a micro-batch takes: enough that `plans_per_stage` x stages
        micro-batches take each once."""
        return max(1, math.ceil(jobs / (self.stages * self.plans_per_stage)))

    def _compose(self) -> PlanMessage | None:
        live = [job for job in self.jobs.values() if job.composable]
        if not live:
            return None
        start = self.rotation % len(live)
        self.rotation += 1
        ordered = live[start:] + live[:start]
        schedule = self.runtime.schedule
        free = [job for job in ordered if not schedule.job_waits(job.name)]
        candidates = free or ordered[:1]
        share = self.share(len(live))
        chosen: list[HeadJob] = []
        tokens = 0
        for job in candidates:
            if len(chosen) >= share:
                break
            batch_tokens = sum(len(e) for e in JobMicroBatch(job=job.name, examples=job.peek()).rows)
            if chosen and tokens + batch_tokens > self.step_tokens:
                continue
            chosen.append(job)
            tokens += batch_tokens
        order = {name: i for i, name in enumerate(self.jobs)}
        chosen.sort(key=lambda job: order[job.name])
        micro_batches, closes, serial, step_targets, olds = [], [], [], {}, {}
        for job in chosen:
            examples = job.pending
            job.pending = None
            replayed = job.replaying
            old = job.composed(examples)
            if old is not None:
                olds[len(micro_batches)] = old
            micro = JobMicroBatch(job=job.name, examples=examples)
            micro_batches.append(micro)
            job.micro_count += 1
            if job.spec.method in PREFERENCE_METHODS:
                job.step_targets += len(examples)
            elif job.spec.grpo is not None and job.spec.grpo.loss_type == "grpo":   # the mean over completions
                job.step_targets += sum(len(rollout.completions) for rollout in examples)
            else:
                job.step_targets += pack([micro], self.layout).job_targets[0]
            if job.spec.lora.dropout > 0:
                serial.append(job.name)
            if (job.replay.iteration_done if replayed else   # a replay closes after the generation's micro-batches
                    job.micro_count % job.spec.grad_accum == 0 or job.peek() is None):
                closes.append(job.name)
                step_targets[job.name] = job.step_targets
                job.step_targets = 0
                job.planned_steps += 1
                if job.replay is not None:
                    job.replay.stepped()
        plan = MicroBatchPlan(index=self.book.next_index, jobs=tuple(mb.job for mb in micro_batches),
                              closes=tuple(closes), serial=tuple(serial), cost=float(tokens))
        self.book.sent(plan)
        dpo = [mb for mb in micro_batches if self.jobs[mb.job].spec.method == "dpo"]
        return PlanMessage(plan=plan, micro_batches=tuple(micro_batches), step_targets=step_targets,
                           references=self._reference_todo(dpo), olds=olds)

    def _reference_todo(self, micro_batches: list[JobMicroBatch]) -> tuple:
        """The DPO pairs the last stage has no reference for (this head's mirror of its caches, kept in step)."""
        if not micro_batches:
            return ()
        caches = [self.reference_caches.setdefault(mb.job, ReferenceCache()) for mb in micro_batches]
        _, todo = ReferenceCache.missing(micro_batches, caches)
        ReferenceCache.store(todo, None, caches)
        return tuple(todo)

    def generate(self, requests: list[tuple[str | None, list[int]]], choose: Callable[[torch.Tensor], list[int]],
                 finished: Callable[[int, int], bool]) -> None:
        """`generate.decode` over the stages (stage_generation.py): every in-flight micro-batch done first, then
        each step through every stage, stage 0 choosing the tokens."""
        self._send((StageMessageKind.DRAIN,))
        request = stage_requests(requests)
        for stage in range(1, self.stages):
            self.links.send_object((StageMessageKind.GENERATE, request), stage, TAG_COMMAND)
        self.runtime.evaluator.generation.lead(request, choose, finished)

    def evaluate(self, name: str, examples: list | None = None, batch_size: int = 8) -> float:
        """The job's mean eval loss over `examples` (default: the eval examples it was added with), as the
        single-device trainer computes it: every in-flight micro-batch and pending step done first."""
        job = self.jobs[name]
        examples = job.eval_examples if examples is None else examples
        if not examples:
            raise ValueError(f"job '{name}' has no eval examples (set eval_split)")
        self._send((StageMessageKind.DRAIN,))
        batches = []
        for start in range(0, len(examples), batch_size):
            micro_batch = JobMicroBatch(job=name, examples=examples[start:start + batch_size])
            todo = self._reference_todo([micro_batch]) if job.spec.method == "dpo" else ()
            batches.append((micro_batch, todo))
        message = (StageMessageKind.EVALUATE, EvalRequest(job=name, batches=tuple(batches)))
        for stage in range(1, self.stages):
            self.links.send_object(message, stage, TAG_COMMAND)
        return float(self.runtime.handle(message))
