"""A sweep's bookkeeping, Ray-free: which trials run, which wait, which were stopped and why, the leaderboard.

Whatever drives a sweep (the scheduler, a client) asks `to_start()` for the trials that may start now (at most
`max_concurrent` at once, in trial order), tells it each objective a trial reports (`report`: successive
halving decides there whether the trial goes on; a stopped trial frees its slot at once) and how each trial
ended (`ended`). `state_dict()` is JSON and `SweepRun.restore(spec, state)` carries on from it with the same
decisions an uninterrupted sweep makes (the halving's records go with it), so a sweep survives what its
driver survives. The objective of a trial is its last reported one (its final adapter's), minimised
(`eval_loss`, `train_loss`). Issue 34: nothing drives it yet."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from actors.engine.spec import JobSpec
from actors.engine.sweep_spec import SweepSpec, trial_job, trial_name
from policies.successive_halving import HalvingDecision, SuccessiveHalving

ACTIVE = ("running",)
ENDED = ("completed", "stopped", "failed", "cancelled")


@dataclass
class Trial:
    name: str
    settings: dict[str, Any]
    state: str = "pending"            # pending | running | completed | stopped | failed | cancelled
    objective: float | None = None    # the last one reported
    steps: int = 0                    # optimizer steps at the last report or end
    stopped_because: str | None = None


class SweepRun:
    def __init__(self, spec: SweepSpec):
        self.spec = spec
        settings = spec.trial_settings()   # drawn once: the jobs and the trials from the same draw
        self.jobs: dict[str, JobSpec] = {}
        self.trials: dict[str, Trial] = {}
        for index, drawn in enumerate(settings):
            job = trial_job(spec.job, drawn, trial_name(spec.job.name, index))
            self.jobs[job.name], self.trials[job.name] = job, Trial(job.name, drawn)
        asha = spec.stopping.asha if spec.stopping is not None else None
        self.halving = None if asha is None else SuccessiveHalving(
            grace_steps=asha.grace_steps, max_steps=spec.job.max_steps or 0, reduction=asha.reduction, mode="min")

    # -- driving ----------------------------------------------------------------------------------
    def to_start(self) -> list[JobSpec]:
        """The trials to start now (marked running): the next pending ones, up to max_concurrent running."""
        free = self.spec.max_concurrent - sum(t.state in ACTIVE for t in self.trials.values())
        starting = [t for t in self.trials.values() if t.state == "pending"][:max(free, 0)]
        for trial in starting:
            trial.state = "running"
        return [self.jobs[trial.name] for trial in starting]

    def report(self, name: str, step: int, objective: float, *, live: bool = True) -> HalvingDecision | None:
        """A running trial's objective after `step` optimizer steps; the halving's decision (None without
        one). A stop decision ends the trial here (`stopped`): the driver cancels its job. `live=False`: the
        trial's job has already ended (its results are read after its end): the results still count at the
        rungs for the trials after it, but there is nothing left to stop (`ended` says how it ended)."""
        trial = self._trial(name)
        if trial.state != "running":
            return None   # a report that crossed the trial's end: already decided
        trial.objective, trial.steps = objective, step
        if self.halving is None:
            if math.isnan(objective) and live:
                trial.state, trial.stopped_because = "stopped", f"objective is NaN at step {step}: the trial diverged"
            return None
        decision = self.halving.report(name, step, objective)
        if decision.stop and live:
            trial.state, trial.stopped_because = "stopped", decision.reason
        return decision

    def ended(self, name: str, state: str, steps: int | None = None, reason: str | None = None) -> None:
        """How a trial's job ended (completed, failed, cancelled); a trial already stopped stays stopped."""
        if state not in ENDED:
            raise ValueError(f"a trial ends completed, stopped, failed or cancelled, not {state!r}")
        trial = self._trial(name)
        if trial.state == "stopped":
            return
        trial.state = state
        trial.steps = steps if steps is not None else trial.steps
        if state != "completed":
            trial.stopped_because = reason or state

    @property
    def done(self) -> bool:
        return all(t.state in ENDED for t in self.trials.values())

    # -- results ----------------------------------------------------------------------------------
    def leaderboard(self) -> dict[str, Any]:
        """`{"trials": [...], "best": NAME | None}`: trials with an objective first, best (lowest) first; the
        best is the best completed trial (a stopped one's objective is from fewer steps)."""
        ordered = sorted(self.trials.values(), key=lambda t: (t.objective is None or math.isnan(t.objective),
                                                              t.objective if t.objective is not None else 0.0))
        completed = [t for t in ordered if t.state == "completed" and t.objective is not None
                     and not math.isnan(t.objective)]
        return {"trials": [asdict(t) for t in ordered], "best": completed[0].name if completed else None}

    # -- persistence ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        halving = None if self.halving is None else {str(rung): dict(recorded)
                                                     for rung, recorded in self.halving.recorded.items()}
        return {"trials": [asdict(t) for t in self.trials.values()], "halving": halving}

    @classmethod
    def restore(cls, spec: SweepSpec, state: dict[str, Any]) -> SweepRun:
        run = cls(spec)
        saved = {t["name"]: Trial(**t) for t in state["trials"]}
        if set(saved) != set(run.trials):
            raise ValueError(f"sweep '{spec.name}': its saved trials ({len(saved)}) are not this file's "
                             f"({len(run.trials)}): the space, trials or seed changed; start it under another name")
        run.trials = {name: saved[name] for name in run.trials}
        if run.halving is not None and state.get("halving"):
            run.halving.recorded = {int(rung): dict(recorded) for rung, recorded in state["halving"].items()}
        return run

    def _trial(self, name: str) -> Trial:
        try:
            return self.trials[name]
        except KeyError:
            raise KeyError(f"sweep '{self.spec.name}' has no trial '{name}'") from None
