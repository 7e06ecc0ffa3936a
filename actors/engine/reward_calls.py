"""A user's GRPO reward functions called in a process of their own, with a deadline (`RewardWorker`, one a
trainer): a reward that never returns, exits the interpreter or crashes it ends its job (a `RewardError` saying
which and what to do), not the trainer and every job on it. The worker (actors/engine/reward_worker.py) is started
at the first call, keeps the functions it loaded (a reward's module state lives as long as it does), and is
stopped after a call that timed out or when its trainer closes it; the next call starts a new one."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

from actors.engine.grpo_rewards import RewardError


class RewardWorker:
    """Calls `function(prompts, completions, rows)` of a `module:function` / `file.py:function` reference in the
    worker process, one call at a time."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def call(self, reference: str, prompts: list[str], completions: list[str], rows: list[dict],
             timeout_s: float) -> list[float | None]:
        """The function's values (numbers or None), as it returned them; RewardError where it could not be
        loaded, raised, returned something else than numbers or None, ran past `timeout_s`, or ended its
        process."""
        request = json.dumps({"reference": reference, "prompts": prompts, "completions": completions, "rows": rows})
        with self.lock:
            process = self._started()
            try:
                assert process.stdin is not None
                process.stdin.write(request + "\n")
                process.stdin.flush()
                line = self._answer(process, timeout_s)
            except BrokenPipeError:
                line = ""
            if not line:
                self._stop()
                raise RewardError(f"grpo.reward '{reference}': its process ended (exit code {process.poll()}) while "
                                  f"scoring {len(completions)} completions (it exited or crashed; its output is in "
                                  "the trainer's log); the job cannot be scored until the function is fixed")
            if line is _LATE:
                self._stop()
                raise RewardError(f"grpo.reward '{reference}' did not return within {timeout_s:g} s "
                                  f"(grpo.reward_timeout_s) on {len(completions)} completions and was stopped; make "
                                  "it faster or raise grpo.reward_timeout_s")
        answer = json.loads(line)
        if "values" in answer:
            return answer["values"]
        message = answer["message"]
        if answer["error"] == "load":
            raise RewardError(message)
        if answer["error"] == "raised":
            raise RewardError(f"grpo.reward '{reference}' raised {message} (on completions such as "
                              f"{completions[0][:80]!r}); it must return a number (or None) for any text")
        raise RewardError(f"grpo.reward '{reference}' returned a reward that is neither a number nor None ({message})")

    def close(self) -> None:
        with self.lock:
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            # the trainer's import path (a Ray runtime environment's folders included), so the worker finds what it
            # finds
            path = os.pathsep.join([p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "actors.engine.reward_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env={**os.environ, "PYTHONPATH": path})
        return self.process

    @staticmethod
    def _answer(process: subprocess.Popen, timeout_s: float) -> Any:
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
