"""Ray object refs behind the small `Pending` interface the Ray-free cores use: a dead job actor surfaces as
`JobLinkLost`, so that the trainer can give its job back to be restarted rather than fail it."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.service.scheduler.job_data import JobUpdate
from actors.service.trainer.feed import FeedChunk, JobLinkLost


class RefPending:
    def __init__(self, ref: ray.ObjectRef, what: str = "the job actor"):
        self.ref = ref
        self.what = what

    def done(self) -> bool:
        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def wait(self, timeout: float) -> bool:
        ready, _ = ray.wait([self.ref], timeout=timeout)
        return bool(ready)

    def result(self) -> Any:
        try:
            return ray.get(self.ref)
        except RayActorError as error:   # also ActorDiedError, ActorUnavailableError
            raise JobLinkLost(f"{self.what} is gone ({type(error).__name__})") from error


class ActorJobLink:
    """A trainer's `JobLink` to a `JobActor`."""

    def __init__(self, job_actor: ray.actor.ActorHandle):
        self.job_actor = job_actor

    def fetch(self, position: dict[str, Any], count: int) -> RefPending:
        return RefPending(self.job_actor.fetch.remote(position, count))

    def update(self, update: JobUpdate) -> RefPending:
        return RefPending(self.job_actor.update.remote(update))


__all__ = ["ActorJobLink", "FeedChunk", "RefPending"]
