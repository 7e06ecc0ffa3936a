"""Tiny bases a pipeline's stage processes can each build alike (picklable loaders), and the single-device
reference run a pipeline's jobs are compared with."""

from __future__ import annotations

import functools

import torch

from actors.engine.job import TrainingJob
from actors.engine.models import BaseModel, from_module
from actors.engine.trainer import FusedTrainer
from tests.helpers.models import MODEL_CLASSES, tiny_config

VOCAB = 300


def tiny_base(arch: str = "llama", layers: int = 4, seed: int = 0, dtype: str = "float32") -> BaseModel:
    config = tiny_config(arch, VOCAB)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(seed)
    model = MODEL_CLASSES[arch](config).eval().to(getattr(torch, dtype))
    return from_module(model, None)


def loader(**kwargs) -> functools.partial:
    return functools.partial(tiny_base, **kwargs)


def single_device(base: BaseModel, jobs, *, recompute: str = "none", step_tokens: int = 100_000):
    """Train (spec, examples, seed) jobs fused on one device to the end: each job's adapter tensors by PEFT
    name, its micro-batch losses in order and its optimizer-step records."""
    trainer = FusedTrainer(base, step_tokens=step_tokens, recompute=recompute)
    created = [TrainingJob.create(spec, base, examples, [], seed=seed) for spec, examples, seed in jobs]
    for job in created:
        trainer.add_job(job)
    losses: dict[str, list[float]] = {job.name: [] for job in created}
    while (report := trainer.train_step()) is not None:
        for result in report.results:
            losses[result.job].append(result.loss)
    weights = {job.name: {k: v.detach().clone() for k, v in job.adapter.named_parameters()} for job in created}
    history = {job.name: job.history for job in created}
    for job in created:
        trainer.remove_job(job.name)
    return weights, losses, history
