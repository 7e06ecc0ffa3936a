"""A fused step's packed batch on its device (`StepBatches`, which `FusedTrainer` holds): packed from the step's
micro-batches (padded to a bucket length where the steps are compiled), or the batch packed and sent while the
step before ran (`send_ahead`: on CUDA, the step most likely to come next), used only when the step holds those
very micro-batches."""

from __future__ import annotations

from actors.engine.compiled import pad_to_bucket
from actors.engine.models import BaseModel
from actors.engine.packing import FusedBatch, JobMicroBatch, pack
from actors.spec.base_settings import Layout


def batch_key(micro_batches: list[JobMicroBatch]) -> tuple:
    """Which micro-batches a batch was packed from: each job's, by the identity of its list of rows."""
    return tuple((mb.job, id(mb.examples)) for mb in micro_batches)


class StepBatches:
    """The steps' batches of one base. `ahead`: the next step's batch is packed during this one (the CUDA
    default: the host packs while the device runs)."""

    def __init__(self, base: BaseModel, layout: Layout, *, bucketed: bool, ahead: bool):
        self.base = base
        self.layout = layout
        self.bucketed = bucketed
        self.ahead = ahead
        self.prepacked: tuple[tuple, FusedBatch] | None = None   # (`batch_key` of its micro-batches, the batch)

    def for_step(self, micro_batches: list[JobMicroBatch]) -> FusedBatch:
        """The step's batch on the device: the one sent ahead when it was packed from these very micro-batches,
        else packed now. Either way, nothing sent ahead is kept for a later step."""
        prepacked, self.prepacked = self.prepacked, None
        if prepacked is not None and prepacked[0] == batch_key(micro_batches):
            return prepacked[1]
        return self.packed(micro_batches)

    def packed(self, micro_batches: list[JobMicroBatch]) -> FusedBatch:
        batch = pack(micro_batches, self.layout, self.base.pad_token_id)
        if self.bucketed:   # a bounded number of stream lengths: compiled graphs
            batch = pad_to_bucket(batch, self.base.pad_token_id)
        return batch.to(self.base.device)

    def send_ahead(self, micro_batches: list[JobMicroBatch]) -> None:
        """Pack the step expected next and send it to the device now (its copy queued without waiting)."""
        self.prepacked = (batch_key(micro_batches), self.packed(micro_batches))

    def drop(self) -> None:
        """What was sent ahead no longer matches the step (e.g. interactive calls joined it)."""
        self.prepacked = None
