"""The process a trainer's GRPO reward functions of users' run in (`python -m actors.engine.reward_worker`; its
parent side: actors/engine/reward_calls.py).

One JSON request a line on stdin, {"reference", "prompts", "completions", "rows"}; one JSON answer a line, {"values":
[number or null, ...]} or {"error": kind, "message": ...} (kind: "load", the function could not be loaded; "raised",
it raised; "value", it returned something that is neither a number nor None). The answers go to the stdout it was
started with; the function's own prints (Python's and C's) go to stderr, beside the trainer's log. The process
ends when its parent does (stdin closed, or the parent gone while a function runs)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, TextIO

from actors.spec.user_functions import UserFunctionError, load_user_function


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        function = load_user_function(request["reference"], "grpo.reward")
    except UserFunctionError as error:
        return {"error": "load", "message": str(error)}
    try:
        values = list(function(request["prompts"], request["completions"], request["rows"]))
    except Exception as error:  # noqa: BLE001 - told to the trainer, which fails the job naming it
        return {"error": "raised", "message": f"{type(error).__name__}: {error}"}
    try:
        return {"values": [None if value is None else float(value) for value in values]}
    except (TypeError, ValueError) as error:
        return {"error": "value", "message": str(error)}


def _end_with_parent(parent: int) -> None:
    """A function that never returns must not outlive the trainer: end when the parent is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def serve(requests: TextIO, answers: TextIO) -> None:
    for line in requests:
        answers.write(json.dumps(_answer(json.loads(line))) + "\n")
        answers.flush()


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")   # the answers' channel; fd 1 (prints) goes to stderr from here on
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_end_with_parent, args=(os.getppid(),), daemon=True).start()
    serve(sys.stdin, answers)


if __name__ == "__main__":
    main()
