"""A pipeline stage's passes without gradients: DPO references, a job's evaluation loss, and decoding
(actors/engine/pipeline/stage_generation.py).

The DPO reference log-probabilities (the base alone, no adapter; kept by the last stage per job) are what a
training forward or an evaluation of a DPO job needs first; the evaluation loss is computed with every stage
taking part, as `FusedTrainer.evaluate` computes it on one device."""

from __future__ import annotations

import torch

from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.layout import step_layout
from actors.engine.loss import target_cross_entropy
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.pipeline.stage_generation import StageDecoder
from actors.engine.pipeline.stage_jobs import StageJob
from actors.engine.pipeline.stage_messages import EvalRequest, StageSettings
from actors.engine.pipeline.stage_model import StageModel
from actors.engine.pipeline.transport import TAG_ACTIVATION, TAG_REPLY, StageLinks
from actors.engine.preference import ReferenceCache, evaluation_outcome, reference_layout, reference_sums
from actors.spec.method_config import PREFERENCE_METHODS


class StageEvaluator:
    """`references` for a plan's or an eval batch's DPO micro-batches, `evaluate` for a job; `forget` a job
    that left. `jobs`: the stage's jobs by name (the runtime's own table, read as it changes)."""

    def __init__(self, model: StageModel, links: StageLinks, settings: StageSettings, jobs: dict[str, StageJob]):
        self.model = model
        self.links = links
        self.settings = settings
        self.jobs = jobs
        self.reference_caches: dict[str, ReferenceCache] = {}   # the last stage's DPO references, by job
        self.generation = StageDecoder(model, links)   # decoding over the stages (eval_generate, "try it")

    def forget(self, job: str) -> None:
        self.reference_caches.pop(job, None)

    def _reference_forward(self, micro_batches: list[JobMicroBatch]) -> list[torch.Tensor] | None:
        """The base alone (no adapter; a job's frozen reference adapter where it holds one) over these pairs, through
        this stage; the last stage returns their reference log-probabilities (`preference.reference_sums`)."""
        base = self.model.base
        batch = pack(micro_batches, "packed", base.pad_token_id).to(base.device)
        hidden = None
        if not self.model.first:
            hidden = self.links.recv((batch.num_tokens, self.model.hidden_size), base.dtype, self.model.stage - 1,
                                     TAG_ACTIVATION)
        adapters = {mb.job: job.reference.name for mb in micro_batches
                    if (job := self.jobs.get(mb.job)) is not None and job.reference is not None}
        with torch.no_grad(), step_layout(reference_layout(batch, adapters)):
            output = self.model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids, hidden=hidden)
        if not self.model.last:
            self.links.send(output, self.model.stage + 1, TAG_ACTIVATION)
            return None
        return reference_sums(base, batch, micro_batches, output, self.settings.loss_chunk)

    def references(self, micro_batches: list[JobMicroBatch], todo: tuple) -> dict[int, torch.Tensor]:
        """The DPO micro-batches' reference log-probabilities by their index among `micro_batches`: the pairs
        in `todo` computed through the stages (every stage takes part), the others from the last stage's
        caches, as `ReferenceCache.lookup` on one device."""
        computed = self._reference_forward([mb for _, _, mb in todo]) if todo else []
        if not self.model.last:
            return {}
        dpo = [index for index, mb in enumerate(micro_batches) if self.jobs[mb.job].spec.method == "dpo"]
        caches = [self.reference_caches.setdefault(micro_batches[index].job, ReferenceCache()) for index in dpo]
        keys, missing = ReferenceCache.missing([micro_batches[index] for index in dpo], caches)
        if [(i, k) for i, k, _ in missing] != [(i, k) for i, k, _ in todo]:
            raise RuntimeError("pipeline: the head's and the last stage's DPO reference caches disagree")
        fresh = ReferenceCache.store(missing, computed, caches)
        return dict(zip(dpo, ReferenceCache.assemble(keys, caches, fresh, self.model.base.device), strict=True))

    def evaluate(self, request: EvalRequest) -> float | None:
        """A job's eval loss, as `FusedTrainer.evaluate` computes it, every stage taking part (the pipeline
        drained first by the head); stage 0 returns it."""
        base = self.model.base
        spec = self.jobs[request.job].spec
        loss_sum, count = 0.0, 0
        set_adapters_training(base.model, False)
        try:
            with torch.no_grad():
                for micro_batch, todo in request.batches:
                    references = self.references([micro_batch], todo) if spec.method == "dpo" else {}
                    batch = pack([micro_batch], "packed", base.pad_token_id).to(base.device)
                    hidden = None
                    if not self.model.first:
                        hidden = self.links.recv((batch.num_tokens, self.model.hidden_size), base.dtype,
                                                 self.model.stage - 1, TAG_ACTIVATION)
                    with step_layout(batch.layout):
                        output = self.model.forward(position_ids=batch.position_ids, input_ids=batch.input_ids,
                                                    hidden=hidden)
                    if not self.model.last:
                        self.links.send(output, self.model.stage + 1, TAG_ACTIVATION)
                        continue
                    if spec.method in PREFERENCE_METHODS:
                        outcome = evaluation_outcome(base, spec.method, spec.preference.beta, batch, micro_batch,
                                                     output, self.settings.loss_chunk, references.get(0),
                                                     spec.preference.cpo_alpha)
                        loss_sum += outcome.loss * outcome.pairs
                        count += outcome.pairs
                        continue
                    head = base.lm_head
                    weights = torch.ones(batch.target_ids.numel(), device=output.device)
                    total, _ = target_cross_entropy(output[batch.target_index], head.weight, head.bias,
                                                    batch.target_ids, weights, self.settings.loss_chunk,
                                                    base.logit_transform)
                    loss_sum += float(total)
                    count += int(batch.target_ids.numel())
        finally:
            set_adapters_training(base.model, True)
        if self.model.last:
            value = loss_sum / max(count, 1)
            if self.model.stages == 1:
                return value
            self.links.send_object(value, 0, TAG_REPLY)
            return None
        return self.links.recv_object(self.model.stages - 1, TAG_REPLY) if self.model.first else None
