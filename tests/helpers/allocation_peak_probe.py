"""Predicts, then measures, one fused step's allocation peak (torch.profiler's count) for each case of GRID, in a
process of its own: run as `python -m tests.helpers.allocation_peak_probe`, prints one JSON line, the relative error
of each case. A process of its own, as a trainer actor is: inside a test worker, what earlier tests left (their
threads allocating, their garbage) can land in the profiled window (a case once measured 14% off in a CI worker,
and within the test's bound alone: not explained further)."""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.data import Example
from actors.engine.adapter_surgery import linear_module_names
from actors.engine.job import TrainingJob
from actors.engine.memory_prior import StepMemoryPrior, probe_base_activation
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from policies.memory_model import MemoryModel, StepShape
from tests.helpers.profiling import profiler_peak


def _held(model: torch.nn.Module, trainer: FusedTrainer) -> int:
    """Bytes of every tensor the trainer holds before a step: each storage once."""
    storages = {}
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for job in trainer.jobs.values() for state in job.optimizer.optimizer.state.values()
                for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _case(dtype: torch.dtype, recompute: str, jobs: int, rank: int, rows: int, length: int,
          dropout: float = 0.0) -> tuple[int, int]:
    """(predicted, measured) peak bytes of the second step of `jobs` jobs of `rows` sequences each."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    base = from_module(LlamaForCausalLM(config).to(dtype), None)
    model = base.model
    linear_shapes = {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features)
                     for n in linear_module_names(model)}
    prior = StepMemoryPrior(base, probe_base_activation(base, recompute=recompute), linear_shapes,
                            recompute=recompute)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    memory = MemoryModel.for_model(weights + prior.activation.constant, prior.activation.per_token,
                                   bytes_per_adapter_parameter=prior.activation.bytes_per_adapter_parameter)
    trainer = FusedTrainer(base, step_tokens=10**6, recompute=recompute)
    example = Example(tuple(range(3, 3 + length)), tuple([-100] * (length // 3) + list(range(3 + length // 3,
                                                                                             3 + length))))
    for j in range(jobs):
        spec = JobSpec(name=f"j{j}", data="x", format={"type": "text"}, batch_size=rows, max_steps=4,
                       warmup_steps=0, lora={"r": rank, "dropout": dropout, "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, [example] * (2 * rows), [], seed=j))
    trainer.train_step()   # the optimizer state exists from here on
    chosen = trainer.compose()
    parts = [(job.spec.lora, rows * length, batch) for job, batch in chosen]
    lengths = [len(e) for _, batch in chosen for e in batch]
    parameters = sum(p.numel() for job in trainer.jobs.values() for p in job.adapter.parameters())
    shape = StepShape.of(lengths, parameters, analytic_bytes=prior.analytic_bytes(parts))
    predicted = memory.predict(shape)
    held = _held(model, trainer)
    measured = held + profiler_peak(lambda: trainer.run_step(chosen))
    return predicted, measured


GRID = [
    (torch.float32, "none", 2, 8, 2, 128, 0.0),
    (torch.float32, "none", 2, 8, 4, 128, 0.0),
    (torch.float32, "none", 4, 8, 2, 96, 0.0),
    (torch.float32, "none", 2, 32, 2, 128, 0.1),
    (torch.float32, "layers", 2, 8, 4, 128, 0.0),
    (torch.bfloat16, "none", 2, 8, 4, 128, 0.0),
    (torch.bfloat16, "layers", 3, 16, 2, 128, 0.1),
]


def main() -> None:
    errors = []
    for case in GRID:
        predicted, measured = _case(*case)
        errors.append(abs(predicted - measured) / measured)
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
