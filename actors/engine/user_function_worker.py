"""The process a trainer's functions of users' run in: GRPO rewards and generation metrics (`python -m
actors.engine.user_function_worker`; its parent side: actors/engine/user_calls.py).

One JSON request a line on stdin, {"reference", "what", "form", "args"}: form "batch" calls the function once on
`args` (a reward: prompts, completions, rows) and takes a number or None for each; form "rows" calls it once a pair of
`args` (a metric: predictions, rows) and takes a number for each. One JSON answer a line, {"values": [...]} or
{"error": kind, "message": ..., "row": index or null} (kind: "load", the function could not be loaded; "raised", it
raised; "value", it returned something that is not a number, or None where a number is due). The answers go to the
stdout it was started with; the functions' own prints (Python's and C's) go to stderr, beside the trainer's log. The
process ends when its parent does (stdin closed, or the parent gone while a function runs)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from actors.spec.user_functions import UserFunctionError, load_user_function


def _number(value: Any, none_allowed: bool) -> float | None:
    if value is None and none_allowed:
        return None
    if value is None:
        raise TypeError("None where a number is due")
    return float(value)


def _batch(function: Callable[..., Any], args: list) -> dict[str, Any]:
    try:
        values = list(function(*args))
    except Exception as error:  # noqa: BLE001 - told to the trainer, which fails the job naming it
        return {"error": "raised", "message": f"{type(error).__name__}: {error}", "row": None}
    try:
        return {"values": [_number(value, none_allowed=True) for value in values]}
    except (TypeError, ValueError) as error:
        return {"error": "value", "message": str(error), "row": None}


def _rows(function: Callable[..., Any], args: list) -> dict[str, Any]:
    values = []
    for row, pair in enumerate(zip(*args, strict=True)):
        try:
            value = function(*pair)
        except Exception as error:  # noqa: BLE001 - told to the trainer, which fails the job naming the row
            return {"error": "raised", "message": f"{type(error).__name__}: {error}", "row": row}
        try:
            values.append(_number(value, none_allowed=False))
        except (TypeError, ValueError) as error:
            return {"error": "value", "message": str(error), "row": row}
    return {"values": values}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        function = load_user_function(request["reference"], request["what"])
    except UserFunctionError as error:
        return {"error": "load", "message": str(error), "row": None}
    if request["form"] == "load":   # only whether it loads (a jobs file's check): nothing called
        return {"values": []}
    return (_batch if request["form"] == "batch" else _rows)(function, request["args"])


def _end_with_parent(parent: int) -> None:
    """A function that never returns must not outlive the trainer: end when the parent is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve(requests: TextIO, answers: TextIO) -> None:
    for line in requests:
        answers.write(json.dumps(answer(json.loads(line))) + "\n")
        answers.flush()


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")   # the answers' channel; fd 1 (prints) goes to stderr from here on
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    serve(sys.stdin, answers)


if __name__ == "__main__":
    main()
