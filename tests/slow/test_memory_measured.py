"""Memory measured against its prediction: a step's allocation peak (torch.profiler), a real trainer's steps against
the fitted memory model, and the peak resident set against the kernel's count (VmHWM) in fresh processes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc only")
@pytest.mark.parametrize("dtype,recompute", [("float32", "none"), ("bfloat16", "layers")])
def test_predicted_peak_resident_set_matches_the_kernels_count(dtype, recompute):
    """A small CPU training in a process of its own: the peak resident set predicted before its first step
    (runtime with the libraries warm, the step's allocator peak, the scratch the allocator does not count)
    against the kernel's VmHWM after eight steps (glibc's heap keeps freed pages resident for the next steps
    to reuse: the peak may creep), within the prediction's goal of 6%."""
    result = subprocess.run([sys.executable, "-m", "tests.helpers.resident_peak_probe", dtype, recompute],
                            capture_output=True, text=True, check=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    r = json.loads(result.stdout.strip().splitlines()[-1])
    step_growth = r["measured"] - r["resident_before"]
    # the steps' share is larger than the tolerance: a prediction that left the steps out would fail
    assert step_growth > 0.06 * r["measured"], r
    assert abs(r["predicted"] - r["measured"]) <= 0.06 * r["measured"], r


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


def test_predicted_peak_matches_the_profilers_allocation_peak():
    errors = []
    for case in GRID:
        predicted, measured = _case(*case)
        errors.append(abs(predicted - measured) / measured)
    assert statistics.median(errors) <= 0.03 and max(errors) <= 0.06, [round(e, 4) for e in errors]


def test_predicts_a_real_trainers_steps_within_three_percent():
    """Forty steps of jobs that arrive over time (tests/helpers/trainer_memory_probe.py, in a process of its own as
    a trainer actor is), each predicted before it runs: from the 24th step on (after the online correction has seen
    three jobs join), within the prediction's goal of 3% on average and 6% at worst, the first step of a job
    that just joined included."""
    result = subprocess.run([sys.executable, "-m", "tests.helpers.trainer_memory_probe"], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-4000:]
    r = json.loads(result.stdout.strip().splitlines()[-1])
    assert r["measured_steps"] == 40 and all(s["memory_measured"] for s in r["steps"])
    rows = [(s["step"], s["jobs"], s["tokens"], s["predicted"], s["measured"],
             round((s["predicted"] - s["measured"]) / s["measured"], 4)) for s in r["steps"]]
    errors = [abs(e) for step, *_, e in rows if step >= 24]
    why = f"on {r['cpu']}: (step, jobs, tokens, predicted, measured, error) {rows}"
    assert float(np.mean(errors)) <= 0.03, why
    assert max(errors) <= 0.06, why
