"""The CUDA path's whole engine on a CPU, for the tests: jobs joining and leaving a trainer between its steps, as a
trainer loop adds a job when it is assigned and removes it once it is done, with each job's losses and final adapter
kept; and the switches that put a CPU trainer on the CUDA path throughout (`on_the_cuda_path`): the adapters in the
base's dtype on their segments (actors/engine/lora_cuda.py, pooled masters and gradients), the optimizer steps on the
device (actors/engine/joint_steps.py `on_device`: the flat AdamW of actors/engine/flat_adamw.py, norms kept on the
device), and the next step's batch packed during this one (`FusedTrainer.batches.ahead`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import actors.engine.trainer as trainer_module
from actors.data import Example
from actors.engine import flat_adamw, lora_cuda, lora_stacks
from actors.engine.job import TrainingJob
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.fused import job_spec
from tests.helpers.isolation import VOCAB
from tests.helpers.models import random_examples


@dataclass
class PlannedJob:
    spec: JobSpec
    examples: list[Example]
    seed: int
    joins_before_step: int = 0   # added to the trainer before this fused step (0: before the first)


@dataclass
class PathCalls:
    """What ran: the CUDA path's layer calls, the flat AdamW's updates (jobs x optimizer steps) and the layers'
    grouped_mm stacks found kept from an earlier step."""
    layers: int = 0
    flat_updates: int = 0
    kept_stacks: int = 0


def on_the_cuda_path(monkeypatch, kernel: str) -> PathCalls:
    """A CPU trainer on the CUDA path from here on (`kernel`: "segments" or "grouped_mm"), counting what it runs."""
    calls = PathCalls()
    monkeypatch.setattr(lora_cuda, "COMPUTE", "base")
    monkeypatch.setattr(lora_cuda, "KERNEL", kernel)
    layer = lora_cuda.linear_with_adapters

    def counted_layer(*args):
        calls.layers += 1
        return layer(*args)

    monkeypatch.setattr(lora_cuda, "linear_with_adapters", counted_layer)
    update = flat_adamw.FlatAdamW.update

    def counted_update(self, factor, targets):
        calls.flat_updates += 1
        return update(self, factor, targets)

    monkeypatch.setattr(flat_adamw.FlatAdamW, "update", counted_update)
    find = lora_stacks.KEPT.find

    def counted_find(layer, key):
        found = find(layer, key)
        calls.kept_stacks += found is not None
        return found

    monkeypatch.setattr(lora_stacks.KEPT, "find", counted_find)
    step_jobs = trainer_module.step_jobs

    def on_device(optimizers, targets, **options):
        return step_jobs(optimizers, targets, **{**options, "on_device": True})

    monkeypatch.setattr(trainer_module, "step_jobs", on_device)
    return calls


def run_planned(base, planned: list[PlannedJob], *, step_tokens: int = 100_000,
                between_steps: Callable[[FusedTrainer, dict[str, TrainingJob]], None] | None = None
                ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, list[float]], int]:
    """Train the planned jobs on one trainer, each added before its step and removed once done: each job's final
    adapter tensors (by PEFT name), its micro-batch losses in order, and the number of fused steps. `between_steps`
    (the trainer, its jobs) runs after each step, before the jobs that are done leave (as a trainer loop evaluates
    them, or continues a prompt with an adapter, between steps)."""
    trainer = FusedTrainer(base, step_tokens=step_tokens)
    trainer.batches.ahead = True
    waiting = sorted(planned, key=lambda job: job.joins_before_step)
    jobs: dict[str, TrainingJob] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    losses: dict[str, list[float]] = {job.spec.name: [] for job in planned}
    steps = 0
    while waiting or jobs:
        while waiting and waiting[0].joins_before_step <= steps:
            job = waiting.pop(0)
            jobs[job.spec.name] = TrainingJob.create(job.spec, base, job.examples, [], seed=job.seed)
            trainer.add_job(jobs[job.spec.name])
        report = trainer.train_step()
        if report is None and not jobs:   # nothing to train until the next job joins
            steps = waiting[0].joins_before_step
            continue
        assert report is not None, f"jobs {sorted(jobs)} are not done but the step had nothing to train"
        for result in report.results:
            losses[result.job].append(result.loss)
        steps += 1
        if between_steps is not None:
            between_steps(trainer, jobs)
        for name, job in list(jobs.items()):
            if job.done:
                weights[name] = {k: v.detach().clone() for k, v in job.adapter.named_parameters()}
                trainer.remove_job(name)
                del jobs[name]
    return weights, losses, steps


def planned_jobs() -> list[PlannedJob]:
    """Four jobs: two from the start (one leaves after 3 steps, one accumulates 2 micro-batches a step), one that
    joins before step 2, one that joins before step 4, after the first left. The first three are of rank 8 (as the
    benchmarks' jobs share one rank, a multiple of 8: grouped_mm's stacks are then kept between steps and must follow
    the steps' changing members), the last of rank 16 (the stacks then padded, made each step); scalings, targets,
    batch sizes, dropout and sequence lengths differ."""
    def examples(seed: int, shortest: int, longest: int):
        return random_examples(seed, count=12, vocab=VOCAB, min_len=shortest, max_len=longest)

    return [
        PlannedJob(job_spec("early", max_steps=3, lr=1e-2, warmup_steps=1,
                            lora={"r": 8, "alpha": 16, "dropout": 0.1, "target_modules": "all-linear"}),
                   examples(0, 4, 20), 0),
        PlannedJob(job_spec("accumulating", batch_size=2, grad_accum=2, max_steps=3, lr=1e-2, warmup_steps=1,
                            lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
                   examples(1, 10, 40), 1),
        PlannedJob(job_spec("late", max_steps=4, lr=1e-2, warmup_steps=1,
                            lora={"r": 8, "alpha": 8, "target_modules": "all-linear"}),
                   examples(2, 5, 30), 2, joins_before_step=2),
        PlannedJob(job_spec("after", batch_size=2, max_steps=2, lr=1e-2, warmup_steps=1,
                            lora={"r": 16, "alpha": 32, "dropout": 0.2, "target_modules": "all-linear"}),
                   examples(3, 8, 24), 3, joins_before_step=4),
    ]


def one_rank_jobs(examples: int = 12) -> list[PlannedJob]:
    """Three jobs of rank 8 on every layer (so that the stacks' layout, siblings' too, is the same fused and alone):
    one accumulating 2 micro-batches a step, one joining before step 2; scalings differ."""
    return [PlannedJob(job_spec(name, batch_size=2, grad_accum=accumulate, max_steps=3, lr=1e-2, warmup_steps=1,
                                lora={"r": 8, "alpha": alpha, "target_modules": "all-linear"}),
                       random_examples(seed, count=examples, vocab=VOCAB, min_len=5, max_len=30), seed, joins)
            for name, accumulate, alpha, seed, joins in (("first", 1, 16, 0, 0), ("accumulating", 2, 8, 1, 0),
                                                         ("late", 1, 32, 2, 1))]


def assert_as_alone(base, planned: list[PlannedJob], fused_weights: dict, fused_losses: dict) -> None:
    """Each planned job's losses and final adapter, trained fused (`run_planned`), exactly those of the job trained
    alone on the same base."""
    trained = 0.0
    for job in planned:
        name = job.spec.name
        solo_weights, solo_losses, _ = run_planned(base, [PlannedJob(job.spec, job.examples, job.seed)])
        assert fused_losses[name] == solo_losses[name], (name, fused_losses[name], solo_losses[name])
        assert len(fused_losses[name]) == job.spec.max_steps * job.spec.grad_accum
        for key, solo in solo_weights[name].items():
            difference = float((fused_weights[name][key].float() - solo.float()).abs().max())
            assert torch.equal(fused_weights[name][key], solo), (name, key, difference)
        trained = max(trained, max(float(w.abs().max()) for k, w in solo_weights[name].items() if "lora_B" in k))
    assert trained > 0, "no adapter trained: nothing was compared"
