"""The scheduling policy's time limit (`policy_timeout_s`). A policy's `decide` ran in the scheduler's loop, under the
service's lock, with no limit: a plug-in that took minutes (or never returned) held every submission, status call and
start of every user until it did. It now runs in a thread of its own, which the round waits for at most the limit;
one that has not answered by then is left running (a thread cannot be stopped from outside) and its late answer
dropped, and it is not called again until that call has returned: two calls of one policy never run at once.

A policy that also composes steps (`compose_step`) is one object in `aspen run --in-process` (local_run.py): the
trainer's steps called its `compose_step` while a `decide` that had overrun still ran in its thread, both on the
policy's own state. Its `compose_step` is now called only while no `decide` runs (`lock`; policy_composer.py). In the
service each trainer loads a policy object of its own (trainer_setup.py), which the scheduler's calls never touch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from policies.base import Decision, Snapshot

POLICY_TIMEOUT_S = 5.0   # ServiceConfig.policy_timeout_s's default


class PolicyOverran(BaseException):
    """The policy did not answer in time, or its call of an earlier round still runs. A BaseException so that the
    guard's handlers of a policy's own exceptions let it through to `PolicyGuard.decide`, which decides the round
    without the policy."""


class PolicyClock:
    """Calls a policy's `decide` in a thread of its own, waiting for it until a deadline."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.running: threading.Thread | None = None   # a call that overran its round and has not returned yet
        self.lock = threading.Lock()   # held while `decide` runs (policy_composer.py waits for it)

    def deadline(self) -> float:
        """The monotonic time by which a round's calls of the policy must have answered."""
        return time.monotonic() + self.limit_s

    def call(self, decide: Callable[[Snapshot], Any], snapshot: Snapshot, deadline: float) -> list[Decision]:
        """`decide(snapshot)`'s answer (or its exception); PolicyOverran where it did not answer by `deadline`, or
        where its call of an earlier round has not returned (it is not called again meanwhile)."""
        if self.running is not None and self.running.is_alive():
            raise PolicyOverran(f"its call of an earlier round has not returned yet (it ran past {self.limit_s:g} s, "
                                "the scheduler's policy_timeout_s)")
        self.running = None
        answer: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                with self.lock:
                    answer["decisions"] = decide(snapshot)
            except BaseException as error:  # noqa: BLE001 - handed to the round that waits for it
                answer["error"] = error
            finally:
                done.set()

        thread = threading.Thread(target=run, name="scheduling-policy", daemon=True)
        thread.start()
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            self.running = thread
            raise PolicyOverran(f"it did not answer within {self.limit_s:g} s (the scheduler's policy_timeout_s)")
        if "error" in answer:
            raise answer["error"]
        return answer["decisions"]
