"""Users' functions a trainer calls (GRPO rewards, generation metrics) run in a process of their own, with a
deadline (`FunctionWorker`, one a trainer): a function that never returns, exits the interpreter or crashes it fails
its call (`CallFailed`, which the caller turns into its job's failure), not the trainer and every job on it. The
worker (actors/engine/user_function_worker.py) is started at the first call, keeps the functions it loaded (their
modules' state lives as long as it does), and is stopped after a call that timed out or ended it, or when its
trainer closes it; the next call starts a new one."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

Form = Literal["batch", "rows", "load"]
"""How the function is called (the worker's docstring): "batch", once on all the arguments (a reward); "rows", once
a row (a metric); "load", not at all: only loaded (a jobs file's check)."""

LOAD_TIMEOUT_S = 60.0
"""How long a function's module may take to import when a jobs or sweep file is checked (a heavy import, e.g.
transformers, takes seconds on a slow machine; one that hangs must not hang the command or the service)."""


@dataclass
class CallFailed(Exception):
    """A call that returned no values. `kind`: "load", "raised", "value" (the worker's), "timeout" (no answer within
    the deadline: the process was stopped) or "ended" (the process ended: `message` has its exit code); `row`:
    the row it failed on, where called a row at a time."""

    kind: str
    message: str
    row: int | None = None
    exit_code: int | None = None   # "ended": the process's

    def __str__(self) -> str:
        return self.message


class FunctionWorker:
    """Calls a `module:function` / `file.py:function` of a user's in the worker process, one call at a time."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def call(self, reference: str, what: str, form: Form, args: list, timeout_s: float) -> list[float | None]:
        """The function's values on `args` (`what`, e.g. "grpo.reward", names it in a load error); CallFailed where
        it could not be loaded, raised, returned other than numbers (or None in a batch), ran past `timeout_s`, or
        ended its process."""
        request = json.dumps({"reference": reference, "what": what, "form": form, "args": args})
        with self.lock:
            process = self._started()
            try:
                assert process.stdin is not None
                process.stdin.write(request + "\n")
                process.stdin.flush()
                line = self._answer(process, timeout_s)
            except BrokenPipeError:
                line = ""
            if line is _LATE:
                self._stop()
                raise CallFailed("timeout", f"did not return within {timeout_s:g} s and was stopped")
            if not line:
                code = process.wait()
                self._stop()
                raise CallFailed("ended", f"its process ended (exit code {code}; it exited or crashed, its output is "
                                          "in the trainer's log)", exit_code=code)
        answer = json.loads(line)
        if "values" in answer:
            return answer["values"]
        raise CallFailed(answer["error"], answer["message"], answer["row"])

    def close(self) -> None:
        with self.lock:
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            # the trainer's import path (a Ray runtime environment's folders included): the worker finds what it finds
            path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "actors.engine.user_function_worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
        return self.process

    @staticmethod
    def _answer(process: subprocess.Popen, timeout_s: float) -> object:
        """The worker's answer line, "" where it ended, `_LATE` where none came within `timeout_s`."""
        assert process.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return _LATE
            readable, _, _ = select.select([process.stdout], [], [], left)
            if readable:
                return process.stdout.readline()

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    stream.close()
            self.process = None

    def __del__(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.kill()


_LATE = object()


def load_problems(references: list[tuple[str, str]], timeout_s: float | None = None) -> list[str | None]:
    """Per (field, reference), why the function cannot be loaded (None: it loads): each loaded in a worker process,
    not the caller's, so that a module that hangs as it is imported, exits or crashes the interpreter is refused
    with what happened instead of stopping `aspen run` or the service that reads the file. One worker for all,
    closed at the end. `timeout_s`: each function's (default LOAD_TIMEOUT_S)."""
    timeout_s = LOAD_TIMEOUT_S if timeout_s is None else timeout_s
    worker = FunctionWorker()
    problems: list[str | None] = []
    try:
        for field, reference in references:
            try:
                worker.call(reference, field, "load", [], timeout_s)
                problems.append(None)
            except CallFailed as failed:
                if failed.kind == "load":
                    problems.append(failed.message)
                elif failed.kind == "timeout":
                    problems.append(f"{field} '{reference}' did not load within {timeout_s:g} s (does its module "
                                    "wait for something as it is imported?) and was stopped")
                else:
                    problems.append(f"{field} '{reference}': importing it ended the process (exit code "
                                    f"{failed.exit_code}: its module exits or crashes the interpreter as it runs)")
    finally:
        worker.close()
    return problems
