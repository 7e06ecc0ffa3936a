"""The LoRA-aware pipeline schedule: which operation each stage runs next, decided the same way on every stage.

A pipeline trainer cuts the base into S stages. Micro-batches (each a fused pack of several jobs' micro-batches,
as a single-device step) enter stage 0 in the order the head composed them, flow forward to the last stage,
which computes their loss and runs their backward at once, and flow back. Jobs are independent (each has its
own adapter), so unlike ordinary pipeline training nothing waits for a flush at an optimizer step: only the
job that steps waits, and only at stage 0, until the stage that finishes its step last (stage 0 itself) has
the job's gradient norm. The rules:
- a job's micro-batches keep their order at every stage (forward and backward both run in plan order), so
  its gradients accumulate in the order a single-device trainer accumulates them;
- a micro-batch enters stage 0 only once, for each of its jobs, the previous micro-batch that closed that
  job's accumulation has finished its backward at stage 0 (there the job's gradient norm over all stages is
  complete and the job steps); each later stage steps the job just before the job's next forward there;
- a job with adapter dropout draws its masks from one random generator whose state moves with its
  activations, so its next micro-batch enters only once its previous one has left the last stage's forward;
- at stage s at most S - s micro-batches are forwarded but not yet backwarded (1F1B's memory bound), and a
  stage runs a ready backward before a ready forward.

The schedule is a discrete-event simulation with costs proportional to the micro-batch's tokens (forward 1,
backward `backward_ratio`); the real stages then run their operations in the order it decided, each
operation waiting for its inputs. Its decisions depend only on the messages fed to it (plans and commands),
never on wall-clock time, so every stage derives the same global order from the same stream of messages
and every send has its receive: no deadlock, no extra coordination. It pauses whenever its next decision
would depend on a plan the head has not composed yet (`wants_plan`).

Pure Python (a policy-layer module): the simulator and bench/pipeline.py run it at 4-16 stages too."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum


@dataclass(frozen=True, kw_only=True)
class MicroBatchPlan:
    """One micro-batch as the schedule sees it: its jobs, which of them close an accumulation with it
    (their optimizer steps follow), which draw dropout masks (serial jobs), and its cost (tokens)."""

    index: int
    jobs: tuple[str, ...]
    closes: tuple[str, ...] = ()
    serial: tuple[str, ...] = ()
    cost: float = 1.0
    not_before: float = 0.0     # the simulator's clock: it enters stage 0 no earlier


class OpKind(StrEnum):
    """What a stage's operation does. The values are the schedule's short letters (its traces and tests read
    them; a StrEnum member equals its letter)."""

    FORWARD = "F"
    BACKWARD = "B"
    FORWARD_BACKWARD = "FB"     # the last stage's forward, loss and backward at once
    OPTIMIZER_STEP = "O"        # a job's optimizer step (`job`), closed by micro-batch `index`
    TAKE_RESULTS = "R"          # stage 0: the last stage's results of micro-batches up to `index`
    REMOVE_JOB = "X"            # a job leaves (`job`)
    READ_JOB = "Q"              # a job's state is read (`job`)


COMPUTE_KINDS = (OpKind.FORWARD, OpKind.BACKWARD, OpKind.FORWARD_BACKWARD)   # a micro-batch's compute


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation of one stage: what it does (`kind`), the micro-batch it concerns (`index`) or the job
    (`job`), and the simulated time it runs."""

    kind: OpKind
    stage: int
    index: int = -1
    job: str = ""
    start: float = 0.0
    end: float = 0.0


@dataclass(kw_only=True)
class _Stage:
    free_at: float = 0.0
    forward_ready: dict[int, float] = field(default_factory=dict)   # index -> when its input arrives
    backward_ready: dict[int, float] = field(default_factory=dict)  # index -> when its output gradient arrives
    in_flight: int = 0
    next_backward: int = 0          # position in `forwarded` of the next backward (plan order)
    forwarded: list[int] = field(default_factory=list)
    pending_steps: dict[str, int] = field(default_factory=dict)    # job -> closing index, not yet stepped here
    busy: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """What an operation costs in the simulation: a micro-batch's cost (tokens) times its stage's weight, times
    `backward_ratio` for a backward; `transfer`: an activation's or gradient's trip to the next stage."""

    backward_ratio: float = 2.0
    weights: tuple[float, ...] = ()
    transfer: float = 0.0

    def of(self, plan: MicroBatchPlan, stage: int, backward: bool) -> float:
        cost = plan.cost * self.weights[stage]
        return cost * self.backward_ratio if backward else cost


@dataclass(kw_only=True)
class _JobGates:
    """Per job, what holds its next micro-batch at stage 0: its optimizer step (stage 0's backward of the
    micro-batch that closed its accumulation) and, for a dropout job, its previous micro-batch's last forward."""

    step_ready: dict[str, float] = field(default_factory=dict)     # when its last closing micro-batch left stage 0
    step_pending: dict[str, int] = field(default_factory=dict)     # closing index whose stage-0 backward is not done
    serial_ready: dict[str, float] = field(default_factory=dict)   # dropout job: its last one left the last forward
    serial_pending: dict[str, int] = field(default_factory=dict)
    serial_seen: dict[str, int] = field(default_factory=dict)      # dropout job: its last micro-batch entered
    last: dict[str, int] = field(default_factory=dict)             # its last planned micro-batch

    def waits(self, job: str) -> bool:
        return job in self.step_pending or job in self.serial_pending

    def forget(self, job: str) -> None:
        for table in (self.step_ready, self.serial_ready, self.serial_pending, self.step_pending, self.last,
                      self.serial_seen):
            table.pop(job, None)


@dataclass(kw_only=True)
class _Flush:
    """A generic pipeline's flush (bench/pipeline.py compares against it): `on`, the jobs of the global batch in
    progress, and when the last stage-0 backward ended."""

    on: bool = False
    since: set[str] = field(default_factory=set)
    time: float = 0.0


class PipelineSchedule:
    """Feed it plans (`add_plan`) and commands (`remove_job`, `read_job`, `drain`); take each stage's
    decided operations with `take(stage)`. `wants_plan` says when stage 0 is ready for a plan not yet fed."""

    def __init__(self, stages: int, *, backward_ratio: float = 2.0, stage_weights: list[float] | None = None,
                 flush: bool = False, transfer: float = 0.0):
        """`flush`: a generic pipeline's schedule for comparison (bench/pipeline.py): every adapter steps at
        once at a flush, so a micro-batch of a job already in the global batch in progress waits until every
        earlier micro-batch has left every stage. `transfer`: the time an activation or its gradient takes
        from one stage to the next (in the same unit as the costs), for simulations."""
        if stages < 1:
            raise ValueError(f"a pipeline needs at least one stage, not {stages}")
        self.stages = stages
        weights = tuple(stage_weights or [1.0] * stages)
        if len(weights) != stages:
            raise ValueError(f"{len(weights)} stage weights for {stages} stages")
        self.costs = StageCosts(backward_ratio=backward_ratio, weights=weights, transfer=transfer)
        self.flush = _Flush(on=flush)
        self.state = [_Stage() for _ in range(stages)]
        self.plans: dict[int, MicroBatchPlan] = {}
        self.next_index = 0                 # the next plan stage 0 forwards
        self.fed = 0                        # plans fed so far
        self.ops: list[deque[Op]] = [deque() for _ in range(stages)]
        self.gates = _JobGates()
        self.commands: deque[tuple[OpKind, str]] = deque()   # (REMOVE_JOB or READ_JOB, job) waiting for its ops
        self.results_taken = -1                     # stage 0 has the last stage's results up to this plan
        self.last_end = 0.0

    @property
    def backward_ratio(self) -> float:
        return self.costs.backward_ratio

    # -- feeding -----------------------------------------------------------------------------------
    def add_plan(self, plan: MicroBatchPlan) -> None:
        if plan.index != self.fed:
            raise ValueError(f"plan {plan.index} fed out of order (expected {self.fed})")
        if not plan.jobs:
            raise ValueError(f"plan {plan.index} has no job")
        self.plans[plan.index] = plan
        self.fed += 1
        for job in plan.jobs:
            self.gates.last[job] = plan.index
        self._advance()

    def remove_job(self, job: str) -> None:
        """The job leaves every stage once its operations there are done and its last step taken (a job
        cancelled mid-accumulation: the head plans none of its micro-batches after, so no step is pending)."""
        self.commands.append((OpKind.REMOVE_JOB, job))
        self._advance()

    def read_job(self, job: str) -> None:
        """Each stage reports the job's state once its operations there are done and its step taken."""
        self.commands.append((OpKind.READ_JOB, job))
        self._advance()

    def drain(self) -> None:
        """No plan follows for now: run every fed plan to its end (and every pending optimizer step)."""
        self._advance(draining=True)

    def take(self, stage: int) -> list[Op]:
        out = list(self.ops[stage])
        self.ops[stage].clear()
        return out

    @property
    def wants_plan(self) -> bool:
        return self.next_index == self.fed and self._stage0_can_forward()

    @property
    def in_flight(self) -> int:
        """Plans entered at stage 0 but not yet backwarded there."""
        return self.next_index - self.state[0].next_backward

    def idle(self) -> bool:
        """Every fed plan has finished."""
        return self.next_index == self.fed and all(s.in_flight == 0 for s in self.state)

    def job_waits(self, job: str) -> bool:
        """Would a micro-batch of `job` composed now wait at stage 0 (for the job's optimizer step or, for
        a dropout job, for its previous micro-batch)? The head composes from jobs that would not, first."""
        return self.gates.waits(job)

    def bubble_share(self) -> list[float]:
        """Each stage's idle share of the simulated time so far."""
        span = max(self.last_end, 1e-12)
        return [1.0 - state.busy / span for state in self.state]

    # -- simulation --------------------------------------------------------------------------------
    def _stage0_can_forward(self) -> bool:
        return self.state[0].in_flight < self.stages

    def _forward_gate(self, index: int) -> float:
        """When plan `index` may enter stage 0 (its jobs' steps and dropout draws done); inf if not yet known."""
        plan = self.plans[index]
        gate = plan.not_before
        gates = self.gates
        for job in plan.jobs:
            if gates.waits(job):
                return math.inf
            gate = max(gate, gates.step_ready.get(job, 0.0), gates.serial_ready.get(job, 0.0))
        if self.flush.on and self.flush.since.intersection(plan.jobs):
            # a generic pipeline: a job's next micro-batch starts a new global batch, after everything
            # before has left every stage (the flush) and every adapter stepped
            if self.state[0].next_backward < index:   # stage 0's backward is a plan's last operation
                return math.inf
            gate = max(gate, self.flush.time)
        return gate

    def _next(self, s: int) -> tuple[float, OpKind, int] | None:
        """Stage s's next operation and when it can start: (start, kind, index), or None."""
        state = self.state[s]
        last = s == self.stages - 1
        backward: tuple[float, int] | None = None
        if not last and state.next_backward < len(state.forwarded):
            index = state.forwarded[state.next_backward]
            if index in state.backward_ready:
                backward = (max(state.free_at, state.backward_ready[index]), index)
        if not last and state.in_flight >= self.stages - s:
            return (backward[0], OpKind.BACKWARD, backward[1]) if backward else None
        forward: tuple[float, int] | None = None
        if s == 0:
            if self.next_index < self.fed:
                gate = self._forward_gate(self.next_index)
                if gate < math.inf:
                    forward = (max(state.free_at, gate), self.next_index)
        elif state.forward_ready:
            index = min(state.forward_ready)
            forward = (max(state.free_at, state.forward_ready[index]), index)
        if backward and (forward is None or backward[0] <= forward[0]):
            return backward[0], OpKind.BACKWARD, backward[1]
        if forward:
            return forward[0], (OpKind.FORWARD_BACKWARD if last else OpKind.FORWARD), forward[1]
        return None

    def _advance(self, draining: bool = False) -> None:
        while True:
            candidates = [(step, s) for s in range(self.stages) if (step := self._next(s)) is not None]
            if not candidates:
                break
            (start, kind, index), s = min(candidates, key=lambda c: (c[0][0], -c[1]))
            if not draining and self.next_index == self.fed and self._stage0_can_forward() \
                    and start >= self.state[0].free_at:
                break   # stage 0 could start a plan not fed yet by then: the head composes it first
            self._run(s, kind, index, start)
        self._place_commands()
        if draining:
            self._place_remaining_steps()

    def _run(self, s: int, kind: OpKind, index: int, start: float) -> None:
        state = self.state[s]
        plan = self.plans[index]
        if kind in (OpKind.FORWARD, OpKind.FORWARD_BACKWARD):
            self._place_steps(s, plan)
            if s == 0:
                self._enter(plan)
            else:
                del state.forward_ready[index]
        costs = self.costs
        if kind == OpKind.FORWARD_BACKWARD:
            cost = costs.of(plan, s, False) + costs.of(plan, s, True)
        else:
            cost = costs.of(plan, s, kind == OpKind.BACKWARD)
        end = start + cost
        state.free_at = end
        state.busy += cost
        self.last_end = max(self.last_end, end)
        self.ops[s].append(Op(kind=kind, stage=s, index=index, start=start, end=end))
        if kind == OpKind.FORWARD:
            state.forwarded.append(index)
            state.in_flight += 1
            self.state[s + 1].forward_ready[index] = end + costs.transfer
            return
        if kind == OpKind.FORWARD_BACKWARD:
            state.forwarded.append(index)
            state.next_backward += 1
            if s > 0:
                self.state[s - 1].backward_ready[index] = end + costs.transfer
            for job in plan.serial:
                if self.gates.serial_pending.get(job) == index:
                    del self.gates.serial_pending[job]
                    self.gates.serial_ready[job] = end + costs.transfer * (self.stages - 1)   # back to stage 0
        else:  # B
            state.in_flight -= 1
            state.next_backward += 1
            del state.backward_ready[index]
            if s > 0:
                self.state[s - 1].backward_ready[index] = end + costs.transfer
        self._backward_done(s, plan, end)

    def _enter(self, plan: MicroBatchPlan) -> None:
        """Plan enters stage 0: stage 0 first takes the results its dropout jobs' generators need."""
        self.next_index += 1
        gates = self.gates
        if self.stages > 1:
            previous = [gates.serial_seen[job] for job in plan.serial if job in gates.serial_seen]
            if previous:
                self._take_results(max(previous))
        for job in plan.jobs:
            gates.step_ready.pop(job, None)
            gates.serial_ready.pop(job, None)
        for job in plan.serial:
            gates.serial_pending[job] = plan.index
            gates.serial_seen[job] = plan.index
        for job in plan.closes:
            gates.step_pending[job] = plan.index
        if self.flush.on:
            if self.flush.since.intersection(plan.jobs):
                self.flush.since.clear()
            self.flush.since.update(plan.jobs)

    def _backward_done(self, s: int, plan: MicroBatchPlan, end: float) -> None:
        for job in plan.closes:
            self.state[s].pending_steps[job] = plan.index
        if s == 0:
            for job in plan.closes:
                if self.gates.step_pending.get(job) == plan.index:
                    del self.gates.step_pending[job]
                    self.gates.step_ready[job] = end
            self.flush.time = max(self.flush.time, end)
            if self.stages > 1:
                self._take_results(plan.index)
            del self.plans[plan.index]   # its last operation: nothing reads it again

    def _take_results(self, index: int) -> None:
        """Stage 0 receives the last stage's results (losses, dropout generators' states) up to `index`:
        before a forward whose dropout jobs need their generators, and after each backward."""
        if index <= self.results_taken:
            return
        self.results_taken = index
        self.ops[0].append(Op(kind=OpKind.TAKE_RESULTS, stage=0, index=index))

    def _place_steps(self, s: int, plan: MicroBatchPlan) -> None:
        """Stage s steps each of the plan's jobs that has a step pending here, before the plan's forward."""
        state = self.state[s]
        for job in plan.jobs:
            if job in state.pending_steps:
                self._place_step(s, job, state.pending_steps.pop(job))

    def _place_step(self, s: int, job: str, index: int) -> None:
        """Stage s steps `job` (its accumulation closed by micro-batch `index`) next."""
        free = self.state[s].free_at
        self.ops[s].append(Op(kind=OpKind.OPTIMIZER_STEP, stage=s, index=index, job=job, start=free, end=free))

    def _job_busy(self, s: int, job: str) -> bool:
        """Has stage s an operation of `job` still to run (a fed plan of it not yet backwarded there)?"""
        state = self.state[s]
        done = state.forwarded[state.next_backward - 1] if state.next_backward else -1
        return self.gates.last.get(job, -1) > done

    def _place_commands(self) -> None:
        while self.commands:
            kind, job = self.commands[0]
            if any(self._job_busy(s, job) for s in range(self.stages)):
                return
            self.commands.popleft()
            if self.stages > 1 and job in self.gates.last:
                self._take_results(self.gates.last[job])
            for s in range(self.stages):
                state = self.state[s]
                if job in state.pending_steps:
                    self._place_step(s, job, state.pending_steps.pop(job))
                self.ops[s].append(Op(kind=kind, stage=s, job=job, start=state.free_at, end=state.free_at))
            if kind == OpKind.REMOVE_JOB:
                self.gates.forget(job)

    def _place_remaining_steps(self) -> None:
        for s in range(self.stages):
            state = self.state[s]
            for job, index in sorted(state.pending_steps.items(), key=lambda item: item[1]):
                self._place_step(s, job, index)
            state.pending_steps.clear()
        if self.stages > 1 and self.fed:
            self._take_results(self.fed - 1)
