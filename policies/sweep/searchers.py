"""Where a sweep's next trial's settings come from: the built-in random and grid searches, or any Ray Tune
searcher (`ray.tune.search.Searcher`: Optuna, HyperOpt, BayesOpt, ...) by its Ray Tune name or `module:Class`.

A sweep asks its searcher for one trial's settings at a time (`suggest`), when it has a free slot, and tells it
what each trial did: every objective as it comes (`on_result`) and, when the trial ends, the objective the
leaderboard shows for it (`on_complete`; none for a trial that failed or diverged before one). So a searcher
that models the objective (Optuna's TPE) draws later trials from the earlier ones' results, exactly as under
Ray Tune, and users keep the searcher they know. `state()` is JSON (a Ray Tune searcher's own `save`,
base64) and `restore(state)` carries on from it, so a resumed sweep asks the searcher it left.

A Ray Tune searcher sees the space in Ray Tune's own terms (`tune.loguniform`, `tune.uniform`,
`tune.randint` with its exclusive upper end, `tune.choice`), keyed by the dotted job paths, and one metric,
`objective`, minimised (a loss) or maximised (a generation metric's score). A choice among values that are
not plain scalars (`lora.target_modules` lists) is offered to it as the values' JSON texts (Optuna's
categories must be scalars) and mapped back."""

from __future__ import annotations

import base64
import importlib
import inspect
import json
import math
import tempfile
from pathlib import Path
from typing import Any, Protocol

from policies.sweep.search_space import Dimension, grid_trials, random_trials

METRIC = "objective"
BUILT_IN = ("random", "grid")
TUNE_SEARCHERS = ("optuna", "hyperopt", "bayesopt", "ax", "bohb", "nevergrad", "zoopt", "hebo")
"""Ray Tune's searchers by the names `ray.tune.search.create_searcher` knows (its `random` is aspen's own)."""
FINISHED = "FINISHED"   # a searcher with nothing more to suggest (Ray Tune's Searcher.FINISHED)


class Searcher(Protocol):
    def suggest(self, trial: str) -> dict[str, Any] | str | None:
        """The settings of trial `trial`; None: none yet (ask again later); FINISHED: no more trials."""

    def on_result(self, trial: str, step: int, objective: float) -> None: ...

    def on_complete(self, trial: str, objective: float | None) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


def check_search(search: str) -> None:
    """Refuse a search that names nothing (before anything starts); whether its package is installed is
    checked when it is built (`build_searcher`)."""
    if search in BUILT_IN or search in TUNE_SEARCHERS:
        return
    module, _, name = search.partition(":")
    if not module or not name or not all(part.isidentifier() for part in [*module.split("."), name]):
        raise ValueError(f"search: {search!r} is not random, grid, a Ray Tune searcher "
                         f"({', '.join(TUNE_SEARCHERS)}) or module:Class")


def build_searcher(search: str, space: dict[str, Dimension], *, trials: int | None, seed: int,
                   options: dict[str, Any] | None = None, mode: str = "min") -> Searcher:
    """The searcher a sweep file names; errors say what to install or fix."""
    check_search(search)
    if search == "grid":
        return ListSearch(grid_trials(space)[:trials])
    if search == "random":
        return ListSearch(random_trials(space, trials or 0, seed))
    return TuneSearch(search, space, seed=seed, options=options or {}, mode=mode)


class ListSearch:
    """Random or grid search: the trials drawn up front, handed out in order (results do not change them)."""

    def __init__(self, settings: list[dict[str, Any]]):
        self.settings, self.given = settings, 0

    def suggest(self, trial: str) -> dict[str, Any] | str | None:
        if self.given >= len(self.settings):
            return FINISHED
        self.given += 1
        return dict(self.settings[self.given - 1])

    def on_result(self, trial: str, step: int, objective: float) -> None:
        pass   # a drawn list does not learn

    def on_complete(self, trial: str, objective: float | None) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"given": self.given}

    def restore(self, state: dict[str, Any]) -> None:
        self.given = int(state["given"])


class TuneSearch:
    """A Ray Tune searcher behind the sweep's `Searcher` interface (module docstring)."""

    def __init__(self, search: str, space: dict[str, Dimension], *, seed: int, options: dict[str, Any],
                 mode: str = "min"):
        """`mode`: "min" (a loss) or "max" (a generation metric's score)."""
        self.name = search
        self.space = space
        self.encoded = {path: not all(_scalar(v) for v in dim.values) for path, dim in space.items()
                        if dim.kind == "choice"}
        cls = _searcher_class(search)
        arguments = dict(options)
        accepted = inspect.signature(cls).parameters
        if "seed" in accepted and "seed" not in arguments:
            arguments["seed"] = seed   # the sweep's seed, where the searcher takes one by that name
        try:
            self.searcher = cls(**arguments)
        except TypeError as error:
            raise ValueError(f"search_options: {search} ({cls.__module__}.{cls.__qualname__}) refused them: {error}; "
                             f"it takes: {', '.join(accepted)}") from None
        except ImportError as error:
            raise ValueError(f"search: {search} needs a package that is not installed ({error}); install it "
                             f"(optuna: pip install 'aspen-lora[sweep]')") from None
        if not self.searcher.set_search_properties(METRIC, mode, self._tune_space()):
            raise ValueError(f"search: {search} was already given a space or metric in search_options; leave "
                             "space, metric and mode to the sweep file")
        self.config: dict[str, dict[str, Any]] = {}   # trial -> the config the searcher gave (its own terms)

    def _tune_space(self) -> dict[str, Any]:
        from ray import tune

        space = {}
        for path, dim in self.space.items():
            if dim.kind == "choice":
                space[path] = tune.choice([_encode(v) for v in dim.values] if self.encoded[path] else list(dim.values))
            elif dim.kind == "loguniform":
                space[path] = tune.loguniform(*dim.values)
            elif dim.kind == "uniform":
                space[path] = tune.uniform(*dim.values)
            else:
                space[path] = tune.randint(dim.values[0], dim.values[1] + 1)   # Ray Tune's upper end is exclusive
        return space

    def suggest(self, trial: str) -> dict[str, Any] | str | None:
        config = self.searcher.suggest(trial)
        if config is None or config == FINISHED:
            return config
        self.config[trial] = dict(config)
        return {path: json.loads(config[path]) if self.encoded.get(path) else config[path] for path in self.space}

    def on_result(self, trial: str, step: int, objective: float) -> None:
        if trial in self.config and not math.isnan(objective):
            self.searcher.on_trial_result(trial, {METRIC: objective, "training_iteration": step,
                                                  "config": self.config[trial]})

    def on_complete(self, trial: str, objective: float | None) -> None:
        if trial not in self.config:
            return
        if objective is None or math.isnan(objective):
            self.searcher.on_trial_complete(trial, None, error=True)
        else:
            self.searcher.on_trial_complete(trial, {METRIC: objective, "config": self.config[trial]})

    def state(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "searcher.pkl"
            self.searcher.save(str(path))
            saved = base64.b64encode(path.read_bytes()).decode()
        return {"searcher": saved, "config": self.config}

    def restore(self, state: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "searcher.pkl"
            path.write_bytes(base64.b64decode(state["searcher"]))
            self.searcher.restore(str(path))
        self.config = {trial: dict(config) for trial, config in state["config"].items()}


def _searcher_class(search: str) -> type:
    if search in TUNE_SEARCHERS:
        try:
            from ray.tune.search import SEARCH_ALG_IMPORT
            return SEARCH_ALG_IMPORT[search]()
        except ImportError as error:
            raise ValueError(f"search: {search} needs a package that is not installed ({error}); install it "
                             f"(optuna: pip install 'aspen-lora[sweep]')") from None
    module_name, _, class_name = search.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"search: cannot import {module_name} ({error}); is it installed, or on PYTHONPATH?") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"search: {module_name} has no class {class_name}")
    missing = [m for m in ("suggest", "on_trial_complete", "on_trial_result", "set_search_properties", "save",
                           "restore") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"search: {search} is not a Ray Tune searcher (ray.tune.search.Searcher): it has no "
                         f"{', '.join(missing)}")
    return cls


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
