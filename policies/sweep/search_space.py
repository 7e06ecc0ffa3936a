"""A sweep's search space and the built-in ways to draw trials from it: random search and grid search.

A space maps a job field's dotted path (`lr`, `lora.r`, `preference.beta`) to one dimension, written as a
one-key mapping:

    {loguniform: [low, high]}    a float, uniform in log space (learning rates)
    {uniform: [low, high]}       a float
    {randint: [low, high]}       an integer, low..high inclusive
    {choice: [a, b, ...]}        one of the values, each equally likely (any YAML value: lists too)

Random search draws every dimension independently from one seeded generator, trial after trial, so a seed
gives the same trials in the same order on any machine. Grid search takes every combination of `choice`
dimensions (in the order written, the last varying fastest); a continuous dimension has no grid and is
refused there, naming it. What a path means (is it a field of the job?) is checked by the sweep spec
(actors/spec/sweep_spec.py), not here."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

KINDS = ("loguniform", "uniform", "randint", "choice")


@dataclass(frozen=True)
class Dimension:
    kind: str
    values: tuple[Any, ...]     # (low, high) for the ranges, the options for choice

    def draw(self, rng: random.Random) -> Any:
        if self.kind == "choice":
            return self.values[rng.randrange(len(self.values))]
        low, high = self.values
        if self.kind == "loguniform":
            return math.exp(rng.uniform(math.log(low), math.log(high)))
        if self.kind == "uniform":
            return rng.uniform(low, high)
        return rng.randint(low, high)

    def corners(self) -> tuple[Any, ...]:
        """The values whose validity stands for the whole dimension's: both ends of a range, every option."""
        return self.values


def parse_space(raw: Any, where: str = "space") -> dict[str, Dimension]:
    """The space from its YAML / JSON form; errors name the entry (`space.lr: ...`) and the fix."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}: give a mapping of job fields to dimensions, e.g. "
                         "{lr: {loguniform: [1.0e-5, 1.0e-3]}, lora.r: {choice: [8, 16]}}")
    space = {}
    for path, spec in raw.items():
        here = f"{where}.{path}"
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ValueError(f"{here}: give one of {', '.join(f'{{{k}: ...}}' for k in KINDS)}, not {spec!r}")
        kind, values = next(iter(spec.items()))
        if kind == "choice":
            if not isinstance(values, list) or not values:
                raise ValueError(f"{here}.choice: give a non-empty list of values, not {values!r}")
            space[path] = Dimension(kind, tuple(values))
            continue
        if (not isinstance(values, list) or len(values) != 2
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)):
            texts = [v for v in values if isinstance(v, str) and _number(v)] if isinstance(values, list) else []
            hint = (f" ({texts[0]!r} is text: YAML reads a number like 1e-5 without a dot as text; write "
                    f"{_with_dot(texts[0])})" if texts else "")
            raise ValueError(f"{here}.{kind}: give [low, high] as two numbers, not {values!r}{hint}")
        low, high = values
        if not low < high:
            raise ValueError(f"{here}.{kind}: low {low} is not below high {high}")
        if kind == "loguniform" and low <= 0:
            raise ValueError(f"{here}.loguniform: low {low} must be above 0 (a log scale); use uniform to include 0")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ValueError(f"{here}.randint: give whole numbers, not {values!r}")
        space[path] = Dimension(kind, (low, high))
    return space


def random_trials(space: dict[str, Dimension], count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{path: dimension.draw(rng) for path, dimension in space.items()} for _ in range(count)]


def grid_trials(space: dict[str, Dimension], where: str = "space") -> list[dict[str, Any]]:
    continuous = [path for path, dimension in space.items() if dimension.kind != "choice"]
    if continuous:
        raise ValueError(f"{where}.{continuous[0]}: a grid search takes only {{choice: [...]}} dimensions; list the "
                         "values to try, or use search: random")
    paths = list(space)
    return [dict(zip(paths, values, strict=True)) for values in itertools.product(*(space[p].values for p in paths))]


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _with_dot(text: str) -> str:
    """1e-5 as YAML reads it as a number: 1.0e-5."""
    mantissa, e, exponent = text.lower().partition("e")
    return f"{mantissa if '.' in mantissa else mantissa + '.0'}{e}{exponent}"
