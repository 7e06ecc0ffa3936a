"""Ray object refs behind the small `Pending` interface the Ray-free cores use."""

from __future__ import annotations

from typing import Any

import ray

from actors.core.feed import FeedChunk
from actors.core.job_data import JobUpdate


class RefPending:
    def __init__(self, ref: ray.ObjectRef):
        self.ref = ref

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def result(self) -> Any:
        return ray.get(self.ref)


class ActorJobLink:
    """A trainer's `JobLink` to a `JobActor`."""

    def __init__(self, job_actor: ray.actor.ActorHandle):
        self.job_actor = job_actor

    def fetch(self, position: dict[str, Any], count: int) -> RefPending:
        return RefPending(self.job_actor.fetch.remote(position, count))

    def update(self, update: JobUpdate) -> RefPending:
        return RefPending(self.job_actor.update.remote(update))


__all__ = ["ActorJobLink", "FeedChunk", "RefPending"]
