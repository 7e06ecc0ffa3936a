"""A plug-in searcher as a user writes one (`search: tests.helpers.searchers:FirstChoices`): a Ray Tune
`Searcher` subclass that tries each choice's options in turn and writes down everything the sweep tells it."""

from __future__ import annotations

import pickle

from ray.tune.search import Searcher


class FirstChoices(Searcher):
    def __init__(self, offset: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.offset, self.space, self.suggested, self.results, self.completed = offset, None, {}, [], {}

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        self._metric, self._mode, self.space = metric, mode, config
        return True

    def suggest(self, trial_id: str):
        index = len(self.suggested) + self.offset
        config = {path: domain.categories[index % len(domain.categories)] if hasattr(domain, "categories")
                  else domain.lower for path, domain in self.space.items()}
        self.suggested[trial_id] = config
        return config

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        self.results.append((trial_id, result["training_iteration"], result[self._metric]))

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.completed[trial_id] = None if error else result[self._metric]

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as file:
            pickle.dump({k: v for k, v in self.__dict__.items() if k != "space"}, file)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as file:
            self.__dict__.update(pickle.load(file))


class FailsAtFirstResult(FirstChoices):
    """`FirstChoices` that raises when it hears its first objective: the sweep fails while that trial's job trains on
    (tests/servers/test_http_sweep_replaced.py: a failed sweep replaced by one of other settings)."""

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        raise RuntimeError(f"planted searcher failure at {trial_id}'s first result")


class FailsAtEveryWord(FirstChoices):
    """`FirstChoices` that raises at whatever the sweep tells it (a result, a trial's end): as a broken plug-in does,
    also while its sweep is cancelled (tests/unit/service/test_sweep_cancel.py,
    tests/servers/test_http_sweep_cancel.py)."""

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        raise RuntimeError(f"planted searcher failure at {trial_id}'s result")

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        raise RuntimeError(f"planted searcher failure at {trial_id}'s end")


class RestoreFails(FirstChoices):
    """`FirstChoices` whose `restore` raises while `broken` (a plug-in's bug, its module gone at a service's start):
    tests/service/test_sweep_broken_searcher.py."""

    broken: type[Exception] | None = RuntimeError
    built = True   # False: its constructor raises (RuntimeError) instead

    def __init__(self, *args, **kwargs):
        if not RestoreFails.built:
            raise RuntimeError("planted constructor failure")
        super().__init__(*args, **kwargs)

    def restore(self, checkpoint_path: str) -> None:
        if RestoreFails.broken is not None:
            raise RestoreFails.broken("planted restore failure")
        super().restore(checkpoint_path)


class StateFails(FirstChoices):
    """`FirstChoices` whose `save` (its sweep's searcher state) and every word raise once `broken` is set."""

    broken = False

    def save(self, checkpoint_path: str) -> None:
        if StateFails.broken:
            raise RuntimeError("planted save failure")
        super().save(checkpoint_path)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if StateFails.broken:
            raise RuntimeError(f"planted searcher failure at {trial_id}'s end")
        super().on_trial_complete(trial_id, result, error)
