"""`JobActor`: one per job. It reads and tokenizes the job's data, serves micro-batches to the job's
trainer ahead of time, books the per-step losses and decides when the job is done (stop rule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from actors.data import Example
from actors.niceness import background_priority, lowest_priority
from actors.service.scheduler.config import StorageConfig
from actors.service.scheduler.job_data import DataSummary, JobData, JobUpdate
from actors.service.trainer.feed import FeedChunk
from actors.spec.job_submission import JobSubmission
from actors.storage.s3_settings import configure_storage
from policies.stopping import LossHistory, Verdict


@ray.remote(num_cpus=0, max_restarts=0)
class JobActor:
    def __init__(self, job_id: str, submission: JobSubmission, cache_dir: str, storage: StorageConfig | None = None):
        """`storage`: the service's `storage:` settings: how its data URI is read."""
        background_priority()   # light work next to the trainers' torch threads (actors/niceness.py)
        if storage is not None:
            configure_storage(storage.settings())
        # imported here, in the job's own process: transformers (and the torch it imports) take seconds, and
        # the scheduler that creates this actor imports this module without needing them
        from actors.storage.sources import load_base_tokenizer

        tokenizer = load_base_tokenizer(submission.base_model, Path(cache_dir))
        self.data = JobData(job_id, submission, tokenizer)

    def prepare(self) -> tuple[DataSummary, list[Example]]:
        summary = self.data.prepare()
        lowest_priority()   # from now on light work only: out of the trainers' way (actors/niceness.py)
        return summary, self.data.eval_examples()

    def fetch(self, position: dict[str, Any], count: int) -> FeedChunk:
        return self.data.fetch(position, count)

    def peek_lengths(self, position: dict[str, Any], batches: int = 1) -> list[int]:
        return self.data.peek_lengths(position, batches)

    def update(self, update: JobUpdate) -> Verdict:
        return self.data.update(update)

    def history(self) -> LossHistory:
        return self.data.history
