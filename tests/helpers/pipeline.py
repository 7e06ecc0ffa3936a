"""Tiny bases a pipeline's stage processes can each build alike (picklable loaders), and the single-device
reference run a pipeline's jobs are compared with."""

from __future__ import annotations

import functools

import torch

from actors.engine.models import BaseModel, from_module
from tests.helpers.isolation import train_fused
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


single_device = train_fused   # the reference a pipeline's jobs are compared with


def background(pipeline) -> None:
    """Run the other stages' processes at background priority, as the scheduler runs (actors/niceness.py):
    a test beside them on the other test worker (a broker, a server) keeps its share of the two cores."""
    import os
    for process in pipeline.processes:
        os.setpriority(os.PRIO_PROCESS, process.pid, 10)
