"""Training jobs fused and alone on one base, and the check that they end bit for bit alike."""

from __future__ import annotations

import pytest
import torch

from actors.data import Example
from actors.engine.job import TrainingJob
from actors.engine.models import from_module, quantize_linears
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.models import random_examples, tiny_model

VOCAB = 300


# (dtype of the base and of its computation, quantization of its linear layers)
CONFIGS = {"float32": (torch.float32, "none"), "bfloat16": (torch.bfloat16, "none"),
           "float16": (torch.float16, "none"), "nf4": (torch.float32, "nf4"), "int8": (torch.float32, "int8"),
           "nf4-bfloat16": (torch.bfloat16, "nf4"), "int8-bfloat16": (torch.bfloat16, "int8")}


def base_for(config: str):
    dtype, quantization = CONFIGS[config]
    model = tiny_model("llama", VOCAB).to(dtype)
    if quantization != "none":
        pytest.importorskip("bitsandbytes")
        quantize_linears(model, quantization, dtype, torch.device("cpu"))
    return from_module(model, None)


def train(base, jobs) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, list[float]]]:
    """Train `jobs` fused to the end; each job's adapter weights and its micro-batch losses in order."""
    weights, losses, history = train_fused(base, jobs)
    for (spec, _, _), records in zip(jobs, history.values(), strict=True):
        assert len(records) == spec.max_steps
    return weights, losses


def train_fused(base, jobs, *, recompute: str = "none", step_tokens: int = 100_000):
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


def assert_isolated(base, jobs) -> None:
    fused_weights, fused_losses = train(base, jobs)
    trained = 0.0
    for job in jobs:
        name = job[0].name
        solo_weights, solo_losses = train(base, [job])
        assert fused_losses[name] == solo_losses[name], (name, fused_losses[name], solo_losses[name])
        for key, solo in solo_weights[name].items():
            difference = float((fused_weights[name][key].float() - solo.float()).abs().max())
            assert torch.equal(fused_weights[name][key], solo), (name, key, difference)
        trained = max(trained, max(float(w.float().abs().max()) for k,
                                   w in solo_weights[name].items() if "lora_B" in k or "vera_lambda_b" in k))
    assert trained > 0, "no adapter trained: nothing was compared"


STEPS = 4


def four_jobs() -> list[tuple[JobSpec, list[Example], int]]:
    """Jobs of different lengths: short, medium, long and mixed sequences, each batch of varied lengths."""
    shapes = [(2, 4, 10, {"r": 4, "alpha": 8}, 1), (3, 12, 30, {"r": 8, "alpha": 16, "dropout": 0.1}, 1),
              (2, 30, 60, {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}, 2),
              (4, 5, 45, {"r": 4, "alpha": 4, "dropout": 0.2}, 1)]
    jobs = []
    for index, (batch_size, shortest, longest, lora, grad_accum) in enumerate(shapes):
        lora = {"target_modules": "all-linear", **lora}
        spec = JobSpec(name=f"job-{index}", data="unused.jsonl", format={"type": "text"}, batch_size=batch_size,
                       grad_accum=grad_accum, max_steps=STEPS if grad_accum == 1 else STEPS // 2, lr=1e-2,
                       lora=lora, warmup_steps=1)
        jobs.append((spec, random_examples(index, count=12, vocab=VOCAB, min_len=shortest, max_len=longest), index))
    return jobs
