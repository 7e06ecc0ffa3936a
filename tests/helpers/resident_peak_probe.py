"""Predicts, then measures, a small CPU training's peak resident memory in a process of its own: run as
`python -m tests.helpers.resident_peak_probe DTYPE RECOMPUTE`, prints one JSON line.

What a CPU trainer does at start (the probe steps; glibc's malloc left as it is), then the
prediction for the jobs' steps, made before their first step from the probe-measured prior alone
(`memory_prior.predict_resident`); then STEPS steps that no profiler watches, and the process's peak
resident set (VmHWM of /proc/self/status: the kernel's count, independent of the engine)."""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.data import Example
from actors.engine.adapter_surgery import linear_module_names
from actors.engine.job import TrainingJob
from actors.engine.memory import (
    live_tensor_bytes,
    model_bytes,
    process_peak_resident_bytes,
    resident_bytes,
)
from actors.engine.memory_prior import StepMemoryPrior, predict_resident, probe_base_activation
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from policies.memory_model import MemoryModel, StepShape

MODEL = dict(vocab_size=8000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
JOBS, ROWS, LENGTH, STEPS = 2, 4, 128, 8


def main(dtype_name: str, recompute: str) -> dict:
    torch.set_num_threads(1)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).to(dtype)
    base = from_module(model, None)
    shapes = {n: (model.get_submodule(n).in_features, model.get_submodule(n).out_features)
              for n in linear_module_names(model)}
    activation = probe_base_activation(base, recompute=recompute)
    prior = StepMemoryPrior(base, activation, shapes, recompute=recompute)
    memory = MemoryModel.for_model(model_bytes(model) + activation.constant, activation.per_token,
                                   bytes_per_adapter_parameter=activation.bytes_per_adapter_parameter)
    trainer = FusedTrainer(base, step_tokens=10**6, recompute=recompute)
    example = Example(tuple(range(3, 3 + LENGTH)), tuple([-100] * 16 + list(range(19, 3 + LENGTH))))
    for j in range(JOBS):
        spec = JobSpec(name=f"j{j}", data="-", format={"type": "text"}, batch_size=ROWS, max_steps=STEPS,
                       warmup_steps=0, lora={"r": 8, "target_modules": "all-linear"})
        trainer.add_job(TrainingJob.create(spec, base, [example] * (2 * ROWS), [], seed=j))
    chosen = trainer.compose()
    parts = [(job.spec.lora, ROWS * LENGTH, batch) for job, batch in chosen]
    parameters = sum(p.numel() for job in trainer.jobs.values() for p in job.adapter.parameters())
    shape = StepShape.of([len(e) for _, b in chosen for e in b], parameters,
                         analytic_bytes=prior.analytic_bytes(parts))
    step_peak = memory.predict(shape)
    optimizers = [job.optimizer.optimizer for job in trainer.jobs.values()]
    before, peak_before = resident_bytes(), process_peak_resident_bytes()
    uncounted = prior.analytic_bytes(parts, resident=True) - prior.analytic_bytes(parts)
    predicted = predict_resident(before, live_tensor_bytes(model, optimizers), step_peak, uncounted, peak_before)
    trainer.run_step(chosen)
    for _ in range(STEPS - 1):   # later steps reuse (or not) the heap pages the earlier ones left resident
        trainer.train_step()
    return {"predicted": predicted, "measured": process_peak_resident_bytes(), "resident_before": before,
            "peak_before": peak_before}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
