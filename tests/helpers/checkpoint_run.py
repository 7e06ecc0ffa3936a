"""A tiny job trained micro-batch by micro-batch, and resumed from a checkpoint, for the checkpoint fault tests."""

from __future__ import annotations

from pathlib import Path

from actors.checkpoint import LoadedCheckpoint, load_checkpoint
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from tests.helpers.checkpoints import VOCAB, spec
from tests.helpers.models import random_examples, tiny_model

A_MICRO_BATCHES = 3  # checkpoint A: step 1, one micro-batch into step 2


B_MICRO_BATCHES = 5  # checkpoint B: step 2, one micro-batch into step 3


class Run:
    """A tiny Llama with the resumable job on its own trainer."""

    def __init__(self) -> None:
        self.base = from_module(tiny_model("llama", VOCAB), None)
        self.trainer = FusedTrainer(self.base)
        self.job = TrainingJob.create(spec(), self.base, random_examples(0, count=10, vocab=VOCAB), [], seed=0)
        self.trainer.add_job(self.job)
        self.micro_batches = 0

    def train_to(self, micro_batches: int | None = None) -> Run:
        while not self.job.done and (micro_batches is None or self.micro_batches < micro_batches):
            self.trainer.train_step()
            self.micro_batches += 1
        return self


def resume(folder: Path) -> tuple[Run, LoadedCheckpoint]:
    """The job of a `Run` resumed from the checkpoint in `folder`, on a trainer of its own, and what loading
    it reported."""
    run = Run.__new__(Run)
    run.base = from_module(tiny_model("llama", VOCAB), None)
    run.trainer = FusedTrainer(run.base)
    run.job = TrainingJob.create(spec(), run.base, random_examples(0, count=10, vocab=VOCAB), [], seed=0)
    loaded = load_checkpoint(run.job, folder)
    run.trainer.add_job(run.job)
    run.micro_batches = -1  # unknown; train_to() without a bound only
    return run, loaded
