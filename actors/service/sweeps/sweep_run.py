"""A sweep's bookkeeping, Ray-free: which trials run, which wait, which were stopped and why, the leaderboard.

Whatever drives a sweep (orchestrator/sweep.py) asks `to_start()` for the trials that may start now (at most
`max_concurrent` at once; each new trial's settings from the sweep's searcher, policies/sweep/searchers.py, when it
starts, so a model-based searcher learns from the trials before it), tells it each objective a trial reports
(`report`: successive halving decides there whether the trial goes on; a stopped trial frees its slot at
once) and how each trial ended (`ended`); the searcher hears both. `state_dict()` is JSON and
`SweepRun.restore(spec, state)` carries on from it with the same decisions an uninterrupted sweep makes (the
halving's records and the searcher's state go with it), so a sweep survives what its driver survives. The
objective of a trial is its last reported one (its final adapter's; with job.keep_best, its best one, whose adapter
it ends with), minimised (`eval_loss`, `train_loss`) or maximised (a generation metric's score: the spec's `mode`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from actors.spec.job_spec import JobSpec
from actors.spec.sweep_spec import SweepSpec, trial_job, trial_name
from policies.sweep.searchers import BUILT_IN, FINISHED, Searcher, build_searcher
from policies.sweep.successive_halving import HalvingDecision, SuccessiveHalving
from policies.sweep.trial_forecast import TrialForecast

ACTIVE = ("running",)
ENDED = ("completed", "stopped", "failed", "cancelled")
KEPT_ERRORS, SHOWN_ERRORS = 20, 5   # a quieted searcher's errors kept, and shown in its sweep's status
CONTINUED = "continued"   # its job, ended, was queued again (`aspen extend`, `aspen resume`): the row follows it


@dataclass
class Trial:
    name: str
    settings: dict[str, Any]
    state: str = "pending"            # pending | running | completed | stopped | failed | cancelled | continued
    objective: float | None = None    # the last one reported (once it ends keeping its best: the best one)
    best: float | None = None         # the best one reported (what a trial keeping its best adapter ends with)
    steps: int = 0                    # optimizer steps at the last report or end
    stopped_because: str | None = None
    continued_from: int | None = None   # the steps it had when its ended job was continued (None: never was)


class SweepRun:
    def __init__(self, spec: SweepSpec, searcher: Searcher | None = None):
        self.spec = spec
        self.searcher = searcher or build_searcher(spec.search, spec.parsed_space(), trials=spec.trials,
                                                   seed=spec.seed, options=spec.search_options, mode=spec.mode)
        self.total = spec.trials if spec.trials is not None else len(spec.trial_settings())
        self.finished = False              # the searcher has nothing more to suggest
        self.saved_searcher: dict[str, Any] | None = None   # its state as last saved (a quieted one's, kept)
        self.replaced: dict[str, Any] | None = None   # the failed or cancelled sweep this one replaced (SweepBook.add)
        self.jobs: dict[str, JobSpec] = {}
        self.trials: dict[str, Trial] = {}   # the trials suggested so far, in trial order
        asha = spec.stopping.asha if spec.stopping is not None else None
        self.halving = None if asha is None else SuccessiveHalving(
            grace_steps=asha.grace_steps, max_steps=spec.job.max_steps or 0, reduction=asha.reduction, mode=spec.mode)
        predictive = spec.stopping.predictive if spec.stopping is not None else None
        self.forecast = None if predictive is None else TrialForecast(
            max_steps=spec.job.max_steps or 0, min_delta=predictive.min_delta, min_points=predictive.min_points)

    # -- driving ----------------------------------------------------------------------------------
    def to_start(self) -> list[JobSpec]:
        """The trials to start now (marked running), up to max_concurrent running: pending ones first (a trial
        whose job was lost), then new ones from the searcher while it has settings to give."""
        free = self.spec.max_concurrent - sum(t.state in ACTIVE for t in self.trials.values())
        starting = [t for t in self.trials.values() if t.state == "pending"][:max(free, 0)]
        while len(starting) < free and len(self.trials) < self.total and not self.finished:
            name = trial_name(self.spec.job.name, len(self.trials))
            settings = self.searcher.suggest(name)
            if settings is None:      # the searcher waits for results before its next suggestion
                break
            if settings == FINISHED:
                self.finished = True
                break
            trial = self.trials[name] = Trial(name, settings)
            try:
                self.jobs[name] = trial_job(self.spec.job, settings, name)
            except ValidationError as error:   # a plug-in searcher's value outside the job's bounds
                problem = error.errors()[0]
                trial.state = "failed"
                trial.stopped_because = (f"the searcher's settings {settings} do not make a valid job: "
                                         f"{'.'.join(map(str, problem['loc']))}: {problem['msg']}")
                self.searcher.on_complete(name, None)
                continue
            starting.append(trial)
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
        self._note(trial, step, objective)
        self.searcher.on_result(name, step, objective)
        decision = self.halving.report(name, step, objective) if self.halving is not None else None
        forecast = self.forecast.report(name, step, objective) if self.forecast is not None else None
        if decision is not None and decision.stop:
            reason = decision.reason
        elif forecast is not None and forecast.stop:
            reason = forecast.reason
        elif math.isnan(objective):
            reason = f"objective is NaN at step {step}: the trial diverged"
        else:
            return decision
        if live:
            trial.state, trial.stopped_because = "stopped", reason
            # as Ray Tune tells a searcher of a stopped trial: its last result (a diverged one: an error)
            self.searcher.on_complete(name, None if math.isnan(objective) else trial.objective)
        return decision or HalvingDecision(True, None, None, reason)

    def ended(self, name: str, state: str, steps: int | None = None, reason: str | None = None) -> None:
        """How a trial's job ended (completed, failed, cancelled); a trial already stopped stays stopped. A continued
        trial's end is its row's alone: the searcher and the stopping rules keep what it gave within the sweep."""
        if state not in ENDED:
            raise ValueError(f"a trial ends completed, stopped, failed or cancelled, not {state!r}")
        trial = self._trial(name)
        if trial.state in ENDED:
            return
        again, trial.state = trial.state == CONTINUED, state
        trial.steps = steps if steps is not None else trial.steps
        if state == "completed" and self.spec.keeps_best and trial.best is not None:
            trial.objective = trial.best   # the adapter it ends with is its best evaluation's (job.keep_best)
        if state != "completed":
            trial.stopped_because = reason or state
        if again:
            return
        if state == "completed" and self.forecast is not None:
            self.forecast.finished(name, trial.objective)
        self.searcher.on_complete(name, trial.objective if state in ("completed", "stopped") else None)

    def continued(self, name: str) -> None:
        """An ended trial's job was queued again by its user (`aspen extend` raised its max_steps, `aspen resume`):
        its row says so (`continued`, from its steps then) until it ends again (`ended`), its objectives meanwhile
        from `report_continued`. It holds none of the sweep's `max_concurrent` slots."""
        trial = self._trial(name)
        if trial.state not in ENDED:
            raise ValueError(f"trial {name} is {trial.state}; only an ended trial is continued")
        trial.state, trial.continued_from, trial.stopped_because = CONTINUED, trial.steps, None

    def report_continued(self, name: str, step: int, objective: float) -> None:
        """A continued trial's objective after `step` steps: its row's (the trial has had its say in the sweep:
        neither the searcher nor the stopping rules hear it, nor stop it; its user asked for these steps)."""
        trial = self._trial(name)
        if trial.state != CONTINUED:
            return
        self._note(trial, step, objective)

    @property
    def done(self) -> bool:
        """Every trial suggested has ended and no more will be (the sweep's count reached, or the searcher
        finished); a trial continued by its user after it ended does not reopen the sweep (its row follows it)."""
        return (len(self.trials) >= self.total or self.finished) and all(t.state in (*ENDED, CONTINUED)
                                                                       for t in self.trials.values())

    # -- results ----------------------------------------------------------------------------------
    def leaderboard(self) -> dict[str, Any]:
        """`{"trials": [...], "best": NAME | None}`: trials with an objective first, best first (the lowest
        loss, the highest score); the best is the best completed trial (a stopped one's objective is from fewer
        steps)."""
        sign = -1.0 if self.spec.mode == "max" else 1.0
        ordered = sorted(self.trials.values(), key=lambda t: (t.objective is None or math.isnan(t.objective),
                                                              sign * t.objective if t.objective is not None else 0.0))
        completed = [t for t in ordered if t.state == "completed" and t.objective is not None
                     and not math.isnan(t.objective)]
        shown = [{key: value for key, value in asdict(t).items() if key != "best"} for t in ordered]
        return {"trials": shown, "best": completed[0].name if completed else None}

    # -- persistence ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        halving = None if self.halving is None else {str(rung): dict(recorded)
                                                     for rung, recorded in self.halving.recorded.items()}
        return {"trials": [asdict(t) for t in self.trials.values()], "halving": halving,
                "forecast": None if self.forecast is None else self.forecast.state_dict(),
                "search": self.spec.search, "searcher": self._searcher_state(), "finished": self.finished,
                "replaced": self.replaced, "searcher_errors": self.searcher_errors()}

    def _searcher_state(self) -> dict[str, Any] | None:
        """The searcher's state now, kept as the last good one (a quieted searcher whose `state` raises keeps it)."""
        self.saved_searcher = self.searcher.state()
        return self.saved_searcher

    @classmethod
    def restore(cls, spec: SweepSpec, state: dict[str, Any], quiet=None, searcher: Searcher | None = None) -> SweepRun:
        """The run as `state_dict` left it; refused (naming what changed) when the file no longer gives those
        trials: another search, or (random, grid) other settings for a trial already run; `SearcherNotRestored`
        where the searcher's `restore` raised. `quiet`: the run is quieted first (a cancelled sweep's: its
        searcher's errors, its restore's too, are kept in its status, not raised). `searcher`: that one instead of
        the spec's (`HeldSearcher`: a sweep held failed as its own searcher cannot be restored)."""
        try:
            run = cls(spec, searcher)
        except (ValueError, KeyError):
            raise
        except Exception as error:   # a plug-in searcher's constructor raising its own error at a service's start
            raise SearcherNotRestored(
                f"sweep '{spec.name}': its searcher {spec.search} cannot be built: it raised "
                f"{type(error).__name__}: {error}; the sweep's state is kept: fix the searcher, then submit the same "
                "sweep file again to carry it on") from error
        if quiet is not None:   # what it raised before (a cancelled sweep's, kept in its state) still shown
            run.quiet(quiet)
            run.searcher.kept(state.get("searcher_errors"))
        if state.get("search", "random") != spec.search:
            raise ValueError(f"sweep '{spec.name}': it ran with search {state.get('search')}, the file now says "
                             f"{spec.search}; start it under another name")
        saved = [Trial(**t) for t in state["trials"]]
        if len(saved) > run.total:
            raise ValueError(f"sweep '{spec.name}': it has run {len(saved)} trials, more than the file's "
                             f"{run.total}; start it under another name")
        if spec.search in BUILT_IN:
            drawn = spec.trial_settings()
            changed = [t.name for index, t in enumerate(saved) if t.settings != drawn[index]]
            if changed:
                raise ValueError(f"sweep '{spec.name}': trial {changed[0]} ran with other settings than the file "
                                 "now gives (the space, trials or seed changed); start it under another name")
        for trial in saved:
            run.trials[trial.name] = trial
            if trial.state in ("pending", "running"):
                run.jobs[trial.name] = trial_job(spec.job, trial.settings, trial.name)
        run.saved_searcher = state.get("searcher")
        try:
            run.searcher.restore(state.get("searcher") or {"given": len(saved)})
        except Exception as error:   # a plug-in searcher's error of any kind (its module gone)
            raise SearcherNotRestored(
                f"sweep '{spec.name}': its searcher {spec.search} cannot be restored from its saved state: its "
                f"restore raised {type(error).__name__}: {error}; the sweep's state is kept: fix the searcher (or "
                "install its module), then submit the same sweep file again to carry it on") from error
        run.finished = bool(state.get("finished"))
        run.replaced = state.get("replaced")
        if run.halving is not None and state.get("halving"):
            run.halving.recorded = {int(rung): dict(recorded) for rung, recorded in state["halving"].items()}
        if run.forecast is not None and state.get("forecast"):
            run.forecast.load_state_dict(state["forecast"])
        return run

    def quiet(self, say) -> list[str]:
        """The searcher's errors from now on (a cancelled sweep's: it is told how its last trials ended) logged with
        `say` and kept in the list answered, not raised: a cancel always ends the sweep (`SweepDriver.cancel`)."""
        if not isinstance(self.searcher, QuietSearcher):
            self.searcher = QuietSearcher(self.searcher, say, self.saved_searcher)
        return self.searcher.errors

    def searcher_errors(self) -> dict[str, Any] | None:
        """What a quieted searcher raised since (its count, the last few), for the sweep's status; None: nothing."""
        if not isinstance(self.searcher, QuietSearcher) or not self.searcher.raised:
            return None
        return {"count": self.searcher.raised, "last": self.searcher.errors[-SHOWN_ERRORS:]}

    @property
    def held(self) -> bool:
        """Its searcher is a `HeldSearcher` (quieted or not): the sweep's own one could not be restored."""
        return isinstance(getattr(self.searcher, "searcher", self.searcher), HeldSearcher)

    def _note(self, trial: Trial, step: int, objective: float) -> None:
        """A trial's objective at `step`: its last one, and its best one where it is better."""
        trial.objective, trial.steps = objective, step
        if not math.isnan(objective) and (trial.best is None or (objective > trial.best if self.spec.mode == "max"
                                                                  else objective < trial.best)):
            trial.best = objective

    def _trial(self, name: str) -> Trial:
        try:
            return self.trials[name]
        except KeyError:
            raise KeyError(f"sweep '{self.spec.name}' has no trial '{name}'") from None


class SearcherNotRestored(ValueError):
    """A sweep's searcher whose `restore` raised (a plug-in's bug, its module gone): that sweep alone fails."""


class HeldSearcher:
    """Stands in for a sweep's searcher that cannot be restored (SweepBook holds the sweep failed): it suggests
    nothing, hears nothing, and gives back the state it was restored from, so that the sweep's state file (written
    as it is cancelled) keeps the searcher's state as it was; the sweep is shown, cancelled or replaced with it."""

    def __init__(self):
        self.saved: dict[str, Any] | None = None

    def suggest(self, trial: str) -> str:
        return FINISHED

    def on_result(self, trial: str, step: int, objective: float) -> None:
        return None

    def on_complete(self, trial: str, objective: float | None) -> None:
        return None

    def state(self) -> dict[str, Any] | None:
        return self.saved

    def restore(self, state: dict[str, Any]) -> None:
        self.saved = state


class QuietSearcher:
    """A searcher whose errors are logged and kept (`errors`: the last `KEPT_ERRORS`; `raised`: how many), not
    raised (`SweepRun.quiet`); its state the last good one it gave (`last`: the one last saved, where it raises
    since)."""

    def __init__(self, searcher: Searcher, say, last: dict[str, Any] | None = None):
        self.searcher, self.say, self.errors, self.raised = searcher, say, [], 0
        self.last_state = self._call("state") or last

    def kept(self, saved: dict[str, Any] | None) -> None:
        """The errors a state file kept (`SweepRun.searcher_errors` as saved), before those raised since."""
        if saved:
            self.errors[:0] = [str(error) for error in saved.get("last", [])]
            self.raised += int(saved.get("count", 0))
            del self.errors[:-KEPT_ERRORS]

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.searcher, method)(*args)
        except Exception as error:  # noqa: BLE001 - a plug-in searcher's error of any kind
            problem = f"the searcher's {method} raised {type(error).__name__}: {error}"
            self.raised += 1
            self.errors.append(problem)
            del self.errors[:-KEPT_ERRORS]
            self.say(f"{problem} (ignored: the sweep is cancelled)")
            return None

    def suggest(self, trial: str) -> dict[str, Any] | str | None:
        return FINISHED   # a cancelled sweep starts no trial

    def on_result(self, trial: str, step: int, objective: float) -> None:
        self._call("on_result", trial, step, objective)

    def on_complete(self, trial: str, objective: float | None) -> None:
        self._call("on_complete", trial, objective)

    def state(self) -> dict[str, Any]:
        self.last_state = self._call("state") or self.last_state
        return self.last_state

    def restore(self, state: dict[str, Any]) -> None:
        raised = self.raised
        self._call("restore", state)
        if self.raised > raised:   # not restored: a fresh searcher's state must not overwrite the one saved
            self.searcher = HeldSearcher()
            self.searcher.restore(state)
        self.last_state = state   # as saved: kept so, whether the searcher took it or not
