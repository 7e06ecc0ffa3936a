"""The trainer's side of a job's link to its job actor: the `Assignment` that starts a job on a trainer, and the
`JobLink` over which the trainer fetches the job's micro-batches and sends it its losses. The link answers each
update with a stop verdict (stop_verdicts.py); `LocalJobLink` is the in-process link, actors/ray_links.py the
one over Ray."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from actors.data import Example
from actors.service.scheduler.job_data import DataSummary, JobData, JobUpdate
from actors.service.trainer.feed import Done, FeedChunk, Pending
from actors.spec.job_submission import JobSubmission
from actors.storage.storage_uri import StorageURI, as_location
from policies.stopping import Verdict


class JobLink(Protocol):
    """The trainer's line to a job's data and history (its job actor, or a `JobData` in-process)."""

    def fetch(self, position: dict[str, Any], count: int) -> Pending[FeedChunk]: ...

    def update(self, update: JobUpdate) -> Pending[Verdict]: ...


class LocalJobLink:
    """A `JobLink` to a `JobData` in this process."""

    def __init__(self, data: JobData):
        self.data = data

    def fetch(self, position: dict[str, Any], count: int) -> Done[FeedChunk]:
        return Done(self.data.fetch(position, count))

    def update(self, update: JobUpdate) -> Done[Verdict]:
        return Done(self.data.update(update))


@dataclass(kw_only=True)
class Assignment:
    """A job for a trainer to start: its submission, where its results go, its data (summary, eval examples,
    and the link to the rest)."""

    job_id: str
    submission: JobSubmission
    output_dir: Path | StorageURI
    data: DataSummary
    eval_examples: list[Example]
    link: JobLink

    def __post_init__(self) -> None:
        self.output_dir = as_location(self.output_dir)   # a URI that went through Path() gets its "//" back
