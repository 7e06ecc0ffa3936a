"""Tiny bases a pipeline's stage processes can each build alike (picklable loaders), the jobs the pipeline
tests train, and the single-device reference run a pipeline's jobs are compared with."""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import torch

from actors.engine.models import BaseModel, from_module
from actors.spec.job_spec import JobSpec
from tests.helpers.fused import job_spec
from tests.helpers.isolation import train_fused
from tests.helpers.models import MODEL_CLASSES, random_examples, tiny_config
from tests.helpers.pairs import random_pairs

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


@dataclasses.dataclass(frozen=True)
class LoaderFailingInStages:
    """A base that loads in the process that made this loader (stage 0's) and not in a stage process: there it
    raises, or (`hang_s`) takes that long first, as a stage that cannot read its share or is still waiting."""

    hang_s: float = 0.0
    owner: int = dataclasses.field(default_factory=os.getpid)

    def __call__(self) -> BaseModel:
        if os.getpid() != self.owner:
            if self.hang_s:
                time.sleep(self.hang_s)
            raise OSError("this stage cannot read its base (a test's failing loader)")
        return tiny_base(layers=LAYERS)


single_device = train_fused   # the reference a pipeline's jobs are compared with


def background(pipeline) -> None:
    """Run the other stages' processes at background priority, as the scheduler runs (actors/niceness.py):
    a test beside them on the other test worker (a broker, a server) keeps its share of the two cores."""
    import os
    for process in pipeline.processes:
        os.setpriority(os.PRIO_PROCESS, process.pid, 10)


LAYERS = 5

def sft(name: str, index: int, steps: int = 4, **overrides):
    lora = {"target_modules": "all-linear", "r": 4, "alpha": 8, **overrides.pop("lora", {})}
    spec = job_spec(name, batch_size=overrides.pop("batch_size", 2), max_steps=steps, lora=lora, **overrides)
    return spec, random_examples(index, count=12, vocab=VOCAB, min_len=5, max_len=30), index

def mixed_jobs(prefix: str) -> list[tuple[JobSpec, list, int]]:
    return [
        sft(f"{prefix}plain", 0),
        sft(f"{prefix}accum", 1, batch_size=3, grad_accum=2, max_grad_norm=0.05, lora={"r": 8, "alpha": 16}),
        sft(f"{prefix}dropout", 2, lora={"dropout": 0.2, "target_modules": ["v_proj", "q_proj"], "r": 2}),
        sft(f"{prefix}dora", 3, lora={"use_dora": True, "dropout": 0.1}),
        sft(f"{prefix}pissa", 4, lora={"init_lora_weights": "pissa"}, max_grad_norm=0.1),
        sft(f"{prefix}plus", 5, lora={"loraplus_lr_ratio": 4.0}, lr_schedule="linear"),
        (JobSpec(name=f"{prefix}orpo", data="unused.jsonl", format={"type": "preference"}, method="orpo",
                 batch_size=2, grad_accum=2, max_steps=2, lr=5e-3, lora={"r": 4, "alpha": 8}), random_pairs(6, 10), 6),
    ]


def assert_same_as_single_device(states: dict[str, dict], heads: dict, jobs, reference=None) -> None:
    weights, losses, history = reference or single_device(tiny_base(layers=LAYERS), jobs)
    moved = 0.0
    for spec, _, _ in jobs:
        name = spec.name
        assert heads[name].losses == losses[name], name
        ours = [(r.step, r.loss, r.lr, r.grad_norm, r.tokens, r.metrics) for r in heads[name].history]
        theirs = [(r.step, r.loss, r.lr, r.grad_norm, r.tokens, r.metrics) for r in history[name]]
        assert ours == theirs, name
        assert set(states[name]["tensors"]) >= set(weights[name])
        for key, value in weights[name].items():
            assert torch.equal(states[name]["tensors"][key], value), (name, key)
        moved = max(moved, max(float(v.abs().max()) for k, v in weights[name].items() if "lora_B" in k))
    assert moved > 0, "no adapter trained: nothing was compared"


def run_and_keep_heads(pipeline, jobs, **run):
    for spec, examples, seed in jobs:
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(**run)
    heads = {spec.name: pipeline.trainer.jobs[spec.name] for spec, _, _ in jobs}
    states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in jobs}
    return states, heads


def preference_job(name: str, method: str, index: int, **overrides):
    spec = JobSpec(name=name, data="unused.jsonl", format={"type": "preference"}, method=method, batch_size=2,
                   lr=5e-3, lora={"r": 4, "alpha": 8}, **{"max_steps": 3, **overrides})
    return spec, random_pairs(index, 6), index


def one_thread_per_process():
    """Each stage process computes with one thread, the reference too (an SVD's or a reduction's rounding may
    depend on the thread count); a generator for a module fixture."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def running_pipeline(stages: int):
    """A module fixture's pipeline of `stages` over the tiny base of LAYERS layers (an even split, one thread in
    every process, this one's too, the other stages at background priority), stopped after the module; a
    generator."""
    from actors.service.pipeline.pipeline_processes import LocalPipeline
    threads = one_thread_per_process()
    next(threads)
    try:
        with LocalPipeline(loader(layers=LAYERS), stages, split="even", threads=1) as running:
            background(running)
            yield running
    finally:
        next(threads, None)
