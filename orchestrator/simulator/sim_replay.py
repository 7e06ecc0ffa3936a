"""The simulation: a trace's jobs replayed under one policy, the trainers stepping like the real one.

Each round the policy (the real class) decides on a snapshot; each trainer composes its fused steps round-robin
within `step_tokens` and the memory budget (or by the policy's own step composer) and costs them with the
trace's calibration; a job's evaluations are drawn from its loss curve, so that the real stop rule
(`policies.stopping.PredictiveRule`) can end it early. A `Move` is carried out like the service does: the job
leaves its trainer at its next step boundary with a checkpoint (`checkpoint_seconds`) and starts on the target
after `job_start_seconds`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from orchestrator.simulator.sim_pipeline import PipelineModel
from orchestrator.simulator.sim_report import Result
from orchestrator.simulator.sim_trace import Trace, TraceJob, TrainerSpec
from policies.adapter_memory import BYTES_PER_ADAPTER_PARAMETER
from policies.base import (
    JobView,
    Move,
    NextBatch,
    Policy,
    Preempt,
    Snapshot,
    Start,
    StepComposer,
    TrainerView,
    UserShare,
)
from policies.memory_model import StepShape
from policies.stopping import LossHistory, PredictiveRule


def layout_tokens(layout: str, lengths: list[tuple[int, ...]]) -> int:
    """Tokens a step of these micro-batches processes (padding included), as `FusedTrainer.step_cost`."""
    if layout == "packed":
        return sum(sum(rows) for rows in lengths)
    if layout == "padded":
        return sum(max(rows) * len(rows) for rows in lengths)
    longest = max(max(rows) for rows in lengths)        # padded_fused: every row to the step's longest
    return longest * sum(len(rows) for rows in lengths)


@dataclass
class SimJob:
    spec: TraceJob
    parameters: int
    rng: np.random.Generator           # its data and its loss noise: the same under every policy
    state: str = "pending"             # pending, queued, starting, running, done
    trainer: str | None = None
    ready_at: float = 0.0
    micro: int = 0                     # micro-batches trained
    step: int = 0                      # optimizer steps
    first_start: float | None = None
    queued_since: float = 0.0
    waited: float = 0.0
    finish: float | None = None
    ended: str = ""
    preempting: bool = False
    tokens: int = 0
    next_lengths: tuple[int, ...] = ()
    history: LossHistory = field(default_factory=LossHistory)
    predicted_stop: int | None = None
    rule: PredictiveRule | None = None
    steps_since_joined: int = 0
    move_to: str | None = None         # leaves its trainer at its next step boundary for this one
    moved_at: float | None = None
    moves: int = 0
    planned: int = 0                   # a pipeline trainer's: micro-batches composed (some still in flight)

    def draw(self) -> tuple[int, ...]:
        spec = self.spec.lengths
        values = self.rng.normal(spec.mean, spec.std, self.spec.batch_size)
        return tuple(int(min(max(round(v), spec.min), spec.max)) for v in values)


@dataclass
class SimTotals:
    """What a replay counts as it goes: steps that ran out of memory, fused steps, and every job's micro-batch
    trained (when, whose, how many tokens: the fair share is judged from them)."""

    ooms: int = 0
    fused_steps: int = 0
    trained: list[tuple[float, str | None, int]] = field(default_factory=list)


class Simulator:
    """A trace replayed under a policy (see the module): the trainers' clocks advance by the calibrated step
    times, the policy decides as the service's would."""

    def __init__(self, trace: Trace, policy: Policy):
        self.trace = trace
        self.policy = policy
        self.composer = policy if isinstance(policy, StepComposer) else None
        self.noise = np.random.default_rng(trace.seed + 7919)
        self.jobs = {j.name: SimJob(j, j.rank * trace.parameters_per_rank, np.random.default_rng([trace.seed, i]))
                     for i, j in enumerate(trace.jobs)}
        for job in self.jobs.values():
            if job.spec.early_stop:
                budget = job.spec.steps
                job.rule = PredictiveRule(job.spec.early_stop.min_improvement, job.spec.early_stop.patience, budget,
                                          every=job.spec.eval_every, min_delta=job.spec.early_stop.min_delta)
        self.clock = {t.id: 0.0 for t in trace.trainers}
        self.trainers = {t.id: t for t in trace.trainers}
        self.rotation = dict.fromkeys(self.clock, 0)
        self.totals = SimTotals()
        self.longest = dict.fromkeys(self.clock, 1)
        self.pipelines = {t.id: PipelineModel(t) for t in trace.trainers if t.stages > 1}

    # -- what the policy sees ---------------------------------------------------------------------------
    def snapshot(self, now: float) -> Snapshot:
        trainers = []
        for spec in self.trainers.values():
            memory = self.trace.calibration.memory
            step = memory.peak(StepShape(spec.step_tokens, spec.step_tokens * min(spec.step_tokens,
                                                                                  self.longest[spec.id]), 0))
            # the jobs a trainer reports: those that reached it (not those still starting)
            on = tuple(j.spec.name for j in self.jobs.values() if j.trainer == spec.id and j.state == "running")
            rate = spec.step_tokens / self.trace.calibration.step.seconds(spec.step_tokens, 0)   # a full step's
            trainers.append(TrainerView(id=spec.id, base_model=self.trace.base_model, quantization="none",
                                        memory_budget_bytes=spec.memory_budget_bytes, base_bytes=int(memory.constant),
                                        step_memory_bytes=int(step - memory.constant), jobs=on, linear_shapes=(),
                                        max_jobs=spec.max_jobs, tokens_per_s=rate))
        views = []
        for job in self.jobs.values():
            if job.state in ("pending", "done"):
                continue
            state = "running" if job.state in ("starting", "running") else "queued"
            spec = job.spec
            remaining = max(job.predicted_stop - job.step, 0) if job.predicted_stop is not None else None
            views.append(JobView(id=spec.name, name=spec.name, state=state, priority=spec.priority,
                                 submitted_at=spec.arrival, base_model=self.trace.base_model, quantization="none",
                                 trainer=job.trainer, step=job.step, total_steps=spec.steps,
                                 memory_bytes=job.parameters * BYTES_PER_ADAPTER_PARAMETER,
                                 tokens_per_step=spec.batch_size * spec.grad_accum * spec.lengths.mean,
                                 predicted_remaining_steps=remaining, preempting=job.preempting,
                                 moving_to=job.move_to if job.preempting else None, moved_at=job.moved_at,
                                 user=spec.user))
        return Snapshot(now, tuple(trainers), tuple(views), users=self.standing(now))

    def standing(self, now: float) -> dict[str | None, UserShare]:
        """The users' shares and tokens trained over the window (as the service's scheduler counts them)."""
        if not self.trace.users:
            return {}
        since = now - self.trace.fair_share_window_s
        trained: dict[str | None, float] = {}
        for when, user, tokens in self.totals.trained:
            if since <= when <= now:
                trained[user] = trained.get(user, 0.0) + tokens
        standing = {name: UserShare(share=share, trained_tokens=trained.get(name, 0.0))
                    for name, share in self.trace.users.items()}
        standing[None] = UserShare(trained_tokens=trained.get(None, 0.0))
        return standing

    def decide(self, now: float) -> None:
        for decision in self.policy.decide(self.snapshot(now)):
            job = self.jobs.get(decision.job)
            if job is None:
                continue
            if isinstance(decision, Start) and job.state == "queued":
                job.state, job.trainer = "starting", decision.trainer
                job.ready_at = max(now, self.clock[decision.trainer]) + self.trace.calibration.job_start_seconds
                job.waited += now - job.queued_since
                if job.first_start is None:
                    job.first_start = now
            elif isinstance(decision, Preempt) and job.state in ("starting", "running"):
                job.preempting = True
            elif (isinstance(decision, Move) and job.state == "running" and not job.preempting
                  and decision.trainer in self.trainers and decision.trainer != job.trainer):
                job.preempting, job.move_to, job.moved_at = True, decision.trainer, now
                job.moves += 1

    # -- one trainer step ---------------------------------------------------------------------------------
    def compose(self, trainer: TrainerSpec, ready: list[SimJob]) -> list[SimJob]:
        def cost(lengths: list[tuple[int, ...]]) -> int:
            return layout_tokens(trainer.layout, lengths)

        def fits(chosen: list[SimJob]) -> bool:
            return self.predicted_peak(trainer, [j.next_lengths for j in chosen]) <= trainer.memory_budget_bytes

        start = self.rotation[trainer.id] % len(ready)
        ordered = ready[start:] + ready[:start]
        self.rotation[trainer.id] += 1
        if self.composer is not None:
            views = [NextBatch(j.spec.name, j.next_lengths, j.steps_since_joined, j.spec.priority) for j in ordered]
            by_name = {j.spec.name: j for j in ordered}
            names = self.composer.compose_step(
                views, lambda vs: cost([v.lengths for v in vs]), trainer.step_tokens,
                lambda vs: fits([by_name[v.job] for v in vs]))
            return [by_name[n] for n in names]
        chosen: list[SimJob] = []
        for job in ordered:
            trial = chosen + [job]
            if chosen and (cost([j.next_lengths for j in trial]) > trainer.step_tokens or not fits(trial)):
                continue
            chosen.append(job)
        return chosen

    def held_parameters(self, trainer_id: str) -> int:
        return sum(j.parameters for j in self.jobs.values() if j.trainer == trainer_id and j.state == "running")

    def predicted_peak(self, trainer: TrainerSpec, lengths: list[tuple[int, ...]]) -> int:
        flat = [n for job_lengths in lengths for n in job_lengths]
        return self.trace.calibration.memory.peak(StepShape.of(flat, self.held_parameters(trainer.id)))

    def step(self, trainer: TrainerSpec, now: float) -> bool:
        """Run one fused step on `trainer` at `now` (its clock); False when nothing happened (no job ready,
        none preempted)."""
        if trainer.id in self.pipelines:
            return self.pipeline_step(trainer, now)
        preempted = False
        for job in self.jobs.values():   # preempted and moved jobs leave at this step boundary, checkpointed
            if job.trainer == trainer.id and job.preempting and job.state in ("starting", "running"):
                job.state, job.trainer, job.preempting, job.queued_since = "queued", None, False, now
                self.clock[trainer.id] = now + self.trace.calibration.checkpoint_seconds
                now = self.clock[trainer.id]
                preempted = True
                if job.move_to is not None:   # started on its target from that checkpoint
                    job.state, job.trainer, job.move_to = "starting", job.move_to, None
                    job.ready_at = now + self.trace.calibration.job_start_seconds
        ready = [j for j in self.jobs.values() if j.trainer == trainer.id and j.state in ("starting", "running")
                 and j.ready_at <= now]
        for job in ready:
            job.state = "running"
            if not job.next_lengths:
                job.next_lengths = job.draw()
        if not ready:
            return preempted
        chosen = self.compose(trainer, ready)
        lengths = [j.next_lengths for j in chosen]
        flat = [n for job_lengths in lengths for n in job_lengths]
        tokens = layout_tokens(trainer.layout, lengths)
        squares = sum(n * n for n in flat)
        noise = self.trace.calibration.memory_noise * abs(self.noise.standard_normal())
        peak = self.predicted_peak(trainer, lengths) * (1 + noise)
        if peak > trainer.memory_budget_bytes:
            self.totals.ooms += 1
        self.longest[trainer.id] = max(self.longest[trainer.id], max(flat))
        end = now + self.trace.calibration.step.seconds(tokens, squares)
        self.clock[trainer.id] = end
        self.totals.fused_steps += 1
        for job in ready:
            job.steps_since_joined = 0 if job in chosen else job.steps_since_joined + 1
        for job in chosen:
            job.tokens += sum(job.next_lengths)
            self.totals.trained.append((end, job.spec.user, sum(job.next_lengths)))
            job.next_lengths = job.draw()
            job.micro += 1
            if job.micro % job.spec.grad_accum == 0:
                job.step += 1
                self.after_optimizer_step(job, end)
        return True

    def pipeline_step(self, trainer: TrainerSpec, now: float) -> bool:
        """A pipeline trainer (actors/engine/pipeline): compose one micro-batch as its head does (up to
        ceil(jobs / stages) jobs, those that would not wait for their own optimizer step first, within
        `step_tokens` and each stage's budget) and give it to the real LoRA-aware schedule
        (actors/engine/pipeline/pipeline_schedule.py), each stage's forward and backward taking 1/stages of the fused
        step's calibrated time; a job's optimizer step lands when its closing micro-batch leaves stage 0's
        backward. The trainer's clock is when stage 0 can take the next micro-batch. Preempted and moved jobs
        leave once the pipeline has drained."""
        model = self.pipelines[trainer.id]
        leaving = [j for j in self.jobs.values() if j.trainer == trainer.id and j.preempting
                   and j.state in ("starting", "running")]
        if leaving:
            self.clock[trainer.id] = max(now, model.drain(self)) + self.trace.calibration.checkpoint_seconds
            for job in leaving:
                job.micro = job.planned
                job.state, job.trainer, job.preempting, job.queued_since = "queued", None, False, now
                if job.move_to is not None:
                    job.state, job.trainer, job.move_to = "starting", job.move_to, None
                    job.ready_at = self.clock[trainer.id] + self.trace.calibration.job_start_seconds
            return True
        ready = [j for j in self.jobs.values() if j.trainer == trainer.id and j.state in ("starting", "running")
                 and j.ready_at <= now and j.planned < j.spec.steps * j.spec.grad_accum]
        for job in ready:
            job.state = "running"
            job.planned = max(job.planned, job.micro)   # a job that trained elsewhere before
            if not job.next_lengths:
                job.next_lengths = job.draw()
        if not ready:
            if not model.in_flight():
                return False
            self.clock[trainer.id] = max(now, model.drain(self))
            return True
        free = [j for j in ready if not model.schedule.job_waits(j.spec.name)]
        chosen = self.compose(trainer, free or ready)[:max(1, math.ceil(len(ready) / trainer.stages))]
        lengths = [j.next_lengths for j in chosen]
        tokens = layout_tokens(trainer.layout, lengths)
        flat = [n for job_lengths in lengths for n in job_lengths]
        if self.predicted_peak(trainer, lengths) / trainer.stages > trainer.memory_budget_bytes:
            self.totals.ooms += 1
        self.longest[trainer.id] = max(self.longest[trainer.id], max(flat))
        seconds = self.trace.calibration.step.seconds(tokens, sum(n * n for n in flat))
        closes = []
        for job in chosen:
            job.tokens += sum(job.next_lengths)
            self.totals.trained.append((now + seconds, job.spec.user, sum(job.next_lengths)))
            job.next_lengths = job.draw()
            job.planned += 1
            if job.planned % job.spec.grad_accum == 0:
                closes.append(job.spec.name)
        self.totals.fused_steps += 1
        model.add(self, [j.spec.name for j in chosen], closes, seconds, now)
        self.clock[trainer.id] = max(now, model.next_free())
        return True

    def after_optimizer_step(self, job: SimJob, now: float) -> None:
        spec = job.spec
        if spec.early_stop and job.step % spec.eval_every == 0:
            job.history.eval.append((job.step, spec.loss.at(job.step, job.rng)))
            decision = job.rule.decide(job.history)
            if decision is not None:
                self.finish(job, now, "stopped_early")
                return
            job.predicted_stop = job.rule.predicted_stop_step(job.history)
        if job.step >= spec.steps:
            self.finish(job, now, "completed")

    def finish(self, job: SimJob, now: float, how: str) -> None:
        job.state, job.finish, job.ended, job.trainer = "done", now, how, None

    def seen_at(self, job: SimJob) -> float:
        """The scheduler's first round after the job arrives."""
        tick = self.trace.tick_seconds
        return math.ceil(job.spec.arrival / tick - 1e-9) * tick

    # -- the whole trace ------------------------------------------------------------------------------------
    def run(self, limit_s: float = 10 * 86400) -> Result:
        now = 0.0
        while any(j.state != "done" for j in self.jobs.values()):
            for job in self.jobs.values():
                if job.state == "pending" and self.seen_at(job) <= now:
                    job.state, job.queued_since = "queued", job.spec.arrival
            self.decide(now)
            # the earliest trainer; of trainers at the same time, one with a job first (an idle one would
            # otherwise wait for a time that never comes)
            holding = {j.trainer for j in self.jobs.values() if j.state in ("starting", "running")}
            trainer_id = min(self.clock, key=lambda t: (self.clock[t], t not in holding))
            trainer = self.trainers[trainer_id]
            at = max(self.clock[trainer_id], now)
            if self.step(trainer, at):
                now = min(self.clock.values()) if len(self.clock) > 1 else self.clock[trainer_id]
                continue
            # nothing ready on the earliest trainer: move time to the next thing that can happen
            upcoming = [self.seen_at(j) for j in self.jobs.values() if j.state == "pending"]
            upcoming += [j.ready_at for j in self.jobs.values() if j.state == "starting" and j.ready_at > at]
            upcoming += [c for t, c in self.clock.items() if c > at]
            if not upcoming:
                stuck = [j.spec.name for j in self.jobs.values() if j.state != "done"]
                raise RuntimeError(f"policy {self.policy.name}: jobs {stuck} can never start (too big for every "
                                   "trainer's memory budget?)")
            self.clock[trainer_id] = max(min(upcoming), at)
            now = min(min(self.clock.values()), min(upcoming))
            if now > limit_s:
                raise RuntimeError(f"policy {self.policy.name}: the trace did not finish within {limit_s:.0f} s")
        jobs = list(self.jobs.values())
        first = min(j.spec.arrival for j in jobs)
        return Result(policy=self.policy.name, turnaround=[j.finish - j.spec.arrival for j in jobs],
                      waiting=[j.waited for j in jobs], makespan=max(j.finish for j in jobs) - first,
                      tokens=sum(j.tokens for j in jobs), steps=sum(j.step for j in jobs), ooms=self.totals.ooms,
                      stopped_early=sum(j.ended == "stopped_early" for j in jobs), fused_steps=self.totals.fused_steps,
                      priorities=[j.spec.priority for j in jobs], moves=sum(j.moves for j in jobs),
                      trained=list(self.totals.trained))
