"""Plug-in policies that misbehave, as third-party code may: loaded by name (`module:Class`) by the fault
tests, in-process and in the service's scheduler actor."""

from __future__ import annotations

from policies.base import Decision, Snapshot
from policies.fifo import FifoPolicy


class FailsOnPoison(FifoPolicy):
    """FIFO, except that it raises whenever a queued job is named `poison`."""

    name = "fails-on-poison"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        if any(j.name == "poison" and j.state == "queued" for j in snapshot.jobs):
            raise ZeroDivisionError("poison pill")
        return super().decide(snapshot)


class AlwaysFails:
    name = "always-fails"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        raise RuntimeError("this policy is broken")


class AnswersGarbage:
    name = "answers-garbage"

    def decide(self, snapshot: Snapshot) -> list[Decision]:
        return ["start everything"]   # type: ignore[list-item]
