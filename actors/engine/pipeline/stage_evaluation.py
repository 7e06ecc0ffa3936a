"""A pipeline stage's passes without gradients: the reference passes of DPO and GRPO jobs, a job's evaluation
loss, and decoding (actors/engine/pipeline/stage_generation.py).

The reference log-probabilities (the base alone, no adapter, or the job's frozen reference adapter) are what a
training forward of a DPO job or of a GRPO job with beta > 0 needs first: a DPO job's pairs once (kept by the last
stage per job), a GRPO job's completion tokens each step (each micro-batch alone, as
`grpo.reference_token_log_probs` on one device). The evaluation loss is computed with every stage taking part, as
`FusedTrainer.evaluate` computes it on one device."""

from __future__ import annotations

import torch

from actors.engine.adapter_surgery import set_adapters_training
from actors.engine.grpo import tempered
from actors.engine.layout import step_layout
from actors.engine.loss import target_cross_entropy, target_log_probs
from actors.engine.packing import FusedBatch, JobMicroBatch, pack
from actors.engine.pipeline.stage_generation import StageDecoder
from actors.engine.pipeline.stage_jobs import StageJob
from actors.engine.pipeline.stage_messages import EvalRequest, PlanMessage, StageSettings
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

    def _reference_forward(self, micro_batches: list[JobMicroBatch]) -> tuple[FusedBatch, torch.Tensor | None]:
        """The base alone (no adapter; a job's frozen reference adapter where it holds one) over these micro-batches
        packed, through this stage: the batch, and the last stage's output (None elsewhere: sent on)."""
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
            return batch, None
        return batch, output

    def plan_references(self, message: PlanMessage) -> dict[int, torch.Tensor]:
        """What a plan's forward needs first, by micro-batch index: its DPO micro-batches' reference sums
        (`references`) and its GRPO jobs' with beta > 0 reference log-probabilities (`grpo_references`); every
        stage takes part, the last one returns them."""
        micro_batches = list(message.micro_batches)
        return self.references(micro_batches, message.references) | self.grpo_references(micro_batches)

    def grpo_references(self, micro_batches: list[JobMicroBatch]) -> dict[int, torch.Tensor]:
        """The reference log-probabilities of the completion tokens of each GRPO micro-batch whose job has beta > 0,
        in the order of its targets: a no-grad forward of that micro-batch alone through the stages, tempered by the
        job's sampling temperature, as `grpo.reference_token_log_probs` on one device."""
        out: dict[int, torch.Tensor] = {}
        for index, micro_batch in enumerate(micro_batches):
            grpo = self.jobs[micro_batch.job].spec.grpo
            if grpo is None or not grpo.beta:
                continue
            batch, output = self._reference_forward([micro_batch])
            if output is None:
                continue
            head, transform = self.model.base.lm_head, tempered(self.model.base.logit_transform, grpo.temperature)
            with torch.no_grad():
                out[index] = target_log_probs(output[batch.target_index], head.weight, head.bias, batch.target_ids,
                                              self.settings.loss_chunk, transform)
        return out

    def references(self, micro_batches: list[JobMicroBatch], todo: tuple) -> dict[int, torch.Tensor]:
        """The DPO micro-batches' reference log-probabilities by their index among `micro_batches`: the pairs
        in `todo` computed through the stages (every stage takes part), the others from the last stage's
        caches, as `ReferenceCache.lookup` on one device."""
        computed = []
        if todo:
            batch, output = self._reference_forward([mb for _, _, mb in todo])
            if output is not None:
                computed = reference_sums(self.model.base, batch, [mb for _, _, mb in todo], output,
                                          self.settings.loss_chunk)
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
