"""The scheduling policy's time limit (`policy_timeout_s`). A policy's `decide` ran in the scheduler's loop, under the
service's lock, with no limit: a plug-in that took minutes (or never returned) held every submission, status call and
start of every user until it did. It now runs in a thread of its own, which the round waits for at most the limit;
one that has not answered by then is left running (a thread cannot be stopped from outside) and its late answer
dropped, and it is not called again until that call has returned: two calls of one policy never run at once. So a
policy that never returns leaves one thread, not one a round; a daemon thread (the service's exit does not wait for
it), counted and said (`left`, `running_said`: the service's info, and the log when it is left). The round waits
for the answer inside `outside` (the scheduler loop's `unlocked`: the service's lock released meanwhile).

A policy that also composes steps (`compose_step`) is one object in `aspen run --in-process` (local_run.py): the
trainer's steps called its `compose_step` while a `decide` that had overrun still ran in its thread, both on the
policy's own state. Its `compose_step` is now called only while no `decide` runs (`lock`; policy_composer.py). In the
service each trainer loads a policy object of its own (trainer_setup.py), which the scheduler's calls never touch."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from policies.base import Decision, Snapshot

log = logging.getLogger(__name__)

Outside = Callable[[], AbstractContextManager[Any]]   # what a round waits for the policy in (SchedulerLoop.unlocked)

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
        self.left = 0                  # calls left running past their round, over the service's life
        self.left_at = 0.0             # the monotonic time the latest of them was left
        self.left_policy = ""          # the policy whose call it is

    def running_said(self) -> str | None:
        """The call left running, said (the service's info), or None where none still runs."""
        if self.running is None or not self.running.is_alive():
            return None
        return (f"policy '{self.left_policy}': its decide has run {time.monotonic() - self.left_at:.0f} s past its "
                f"time limit ({self.limit_s:g} s, policy_timeout_s) in its thread, which cannot be stopped: it is "
                "left running (a daemon thread: the service's exit does not wait for it), and the policy is not "
                "called again while it runs")

    def deadline(self) -> float:
        """The monotonic time by which a round's calls of the policy must have answered."""
        return time.monotonic() + self.limit_s

    def call(self, decide: Callable[[Snapshot], Any], snapshot: Snapshot, deadline: float, name: str = "?",
             outside: Outside = contextlib.nullcontext) -> list[Decision]:
        """`decide(snapshot)`'s answer (or its exception), waited for inside `outside()`; PolicyOverran where it did
        not answer by `deadline`, or where its call of an earlier round has not returned (it is not called again
        meanwhile). `name`: the policy's, which the log and the info say."""
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

        thread = threading.Thread(target=run, name=f"scheduling-policy {name}", daemon=True)
        thread.start()
        with outside():
            answered = done.wait(max(deadline - time.monotonic(), 0.0))
        if not answered:
            self.running, self.left, self.left_at, self.left_policy = thread, self.left + 1, time.monotonic(), name
            log.warning("scheduler: policy '%s': its decide did not answer within %g s (policy_timeout_s) and is left "
                        "running in its thread (a thread cannot be stopped; %d so far); the policy is not called "
                        "again while it runs", name, self.limit_s, self.left)
            raise PolicyOverran(f"it did not answer within {self.limit_s:g} s (the scheduler's policy_timeout_s)")
        if "error" in answer:
            raise answer["error"]
        return answer["decisions"]
