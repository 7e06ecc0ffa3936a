"""What a trainer holds of its jobs' reference models: DPO jobs' cached reference log-probabilities
(`preference.ReferenceCache`), and frozen reference adapters. A dpo job, or a grpo job with a KL term, that starts
from a saved adapter (`init_adapter`) compares itself with that adapter, not with the bare base, as TRL's trainers
do with a PEFT model whose adapter was trained before (a frozen copy, "ref"). The copy is one more adapter on the
shared base, under the job's name and `@reference`, with no dropout and no gradients; only the reference passes
put it in their layout (`preference.reference_layout`), so no step's forward and no other job ever sees it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from actors.engine.adapter_surgery import AdapterHandle, add_adapter, remove_adapter
from actors.engine.grpo import reference_token_log_probs
from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel
from actors.engine.packing import JobMicroBatch
from actors.engine.preference import ReferenceCache, reference_adapter_name
from actors.spec.job_spec import JobSpec


class JobReferences:
    """The reference adapters a trainer holds, by job name, and its DPO jobs' reference caches."""

    def __init__(self, base: BaseModel):
        self.base = base
        self.held: dict[str, AdapterHandle] = {}
        self.caches: dict[str, ReferenceCache] = {}   # DPO jobs' reference log-probabilities, by pair

    def cache(self, job: str) -> ReferenceCache:
        """The job's reference cache (a new one at its first use)."""
        return self.caches.setdefault(job, ReferenceCache())

    def hold(self, spec: JobSpec, seed: int, load: Callable[[AdapterHandle], object]) -> AdapterHandle:
        """A frozen adapter of the job's shape on the base, its weights given by `load` (which raises where they
        cannot be had: then nothing of it stays on the base); held until `drop`."""
        if spec.name in self.held:
            raise ValueError(f"job '{spec.name}' already has a reference adapter on this trainer")
        name = reference_adapter_name(spec.name)
        lora = spec.lora.model_copy(update={"dropout": 0.0})   # a fixed reference: TRL disables dropout too
        handle = add_adapter(self.base.model, name, lora, seed=seed)
        try:
            load(handle)
        except BaseException:
            remove_adapter(self.base.model, name)
            raise
        for parameter in handle.parameters():
            parameter.requires_grad_(False)
        self.held[spec.name] = handle
        return handle

    def drop(self, job: str) -> None:
        """The job's reference adapter off the base (nothing where it holds none), and its cache gone."""
        self.caches.pop(job, None)
        if self.held.pop(job, None) is not None:
            remove_adapter(self.base.model, reference_adapter_name(job))

    def names(self, jobs: Iterable[str]) -> dict[str, str]:
        """Job -> its reference adapter's name, for those of `jobs` that have one (`reference_layout`)."""
        return {job: self.held[job].name for job in jobs if job in self.held}

    def name_of(self, job: str) -> str | None:
        handle = self.held.get(job)
        return handle.name if handle is not None else None

    def for_step(self, jobs: list[TrainingJob], micro_batches: list[JobMicroBatch], loss_chunk: int
                 ) -> dict[int, torch.Tensor]:
        """The references of a step's jobs (`jobs[i]` with `micro_batches[i]`), by index, before its forward: the
        DPO jobs' reference log-probabilities ((pairs, 2) each), a no-grad forward of their sequences without the
        job's adapter (`preference.reference_log_probs`) for the pairs not yet in the job's cache; the GRPO jobs'
        with beta > 0 per completion token (a no-grad forward each)."""
        references = {index: reference_token_log_probs(self.base, micro_batches[index], job.spec.grpo.temperature,
                                                       loss_chunk, self.name_of(job.name))
                      for index, job in enumerate(jobs) if job.spec.grpo is not None and job.spec.grpo.beta}
        dpo = [index for index, job in enumerate(jobs) if job.spec.method == "dpo"]
        if not dpo:
            return references
        caches = [self.cache(jobs[index].name) for index in dpo]
        sums = ReferenceCache.lookup(self.base, [micro_batches[index] for index in dpo], caches, loss_chunk,
                                     self.names(jobs[index].name for index in dpo))
        return references | dict(zip(dpo, sums, strict=True))
