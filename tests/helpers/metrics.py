"""User metric functions for eval_generate tests (imported by name, as a user's `module:function`)."""

from __future__ import annotations

import json
import os

CALLS_FILE = "ASPEN_TEST_METRIC_CALLS"
"""The environment variable naming the file `recorded` appends its calls to (it runs in the trainer's process of
users' functions, not the test's)."""


def recorded(prediction: str, row: dict) -> float:
    """Records its call (a JSON line [prediction, row] in $ASPEN_TEST_METRIC_CALLS, where set); scores a text by its
    length (so that different continuations score differently)."""
    if os.environ.get(CALLS_FILE):
        with open(os.environ[CALLS_FILE], "a") as calls:
            calls.write(json.dumps([prediction, row]) + "\n")
    return (len(prediction) % 7) / 6


def recorded_calls(path) -> list[tuple[str, dict]]:
    """The (prediction, row) calls `recorded` appended to `path`, in order."""
    if not os.path.exists(path):
        return []
    with open(path) as calls:
        return [tuple(json.loads(line)) for line in calls]


def broken(prediction: str, row: dict) -> float:
    raise KeyError("answer")


def hangs(prediction: str, row: dict) -> float:
    """A metric that never returns (a judge that never answers)."""
    import time

    while True:
        time.sleep(1.0)


def says(prediction: str, row: dict) -> str | float:
    """A number for the first row, a word for the next."""
    return 1.0 if row["reference"] == "first" else "yes"
