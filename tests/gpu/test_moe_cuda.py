"""MoE bases on CUDA (skipped without it; the lease runs tests/gpu): transformers' own grouped experts stay (the
CPU's sequence-by-sequence experts, actors/engine/moe_experts.py, are for the CPU's bit-for-bit claim), and a
first fused step of three jobs on a tiny Qwen3-MoE in float32 gives each job its loss alone within the rounding
tolerance of the model's longest chain of sums (tests/helpers/tolerances.py; on CUDA a product over more rows may
take another algorithm). The first job also adapts the expert stacks (actors/engine/experts_lora.py): on CUDA its
layers holding such adapters then compute their experts job by job. The same check runs on the
CPU, where it holds exactly."""

from __future__ import annotations

import pytest
import torch

from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.moe_experts import EXPERTS_NAME
from actors.engine.trainer import FusedTrainer
from tests.helpers.fused import job_spec
from tests.helpers.model_families import VOCAB, build_config, build_model
from tests.helpers.models import random_examples
from tests.helpers.tolerances import llama_chain_terms, rounding_tolerance

LORAS = ({"r": 8, "alpha": 16, "target_modules": "all-linear",
          "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
         {"r": 4, "alpha": 8, "target_modules": "all-linear"},
         {"r": 16, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})


def first_step_losses(device: str, jobs: list[int]) -> list[float]:
    base = from_module(build_model(build_config("qwen3_moe")).to(device), None)
    assert (base.model.config._experts_implementation == EXPERTS_NAME) == (device == "cpu")
    trainer = FusedTrainer(base, step_tokens=100_000)
    for index in jobs:
        job = TrainingJob.create(job_spec(f"job-{index}", lora=LORAS[index]), base,
                                 random_examples(index, vocab=VOCAB), [], seed=index)
        with torch.no_grad():   # B non-zero: the adapters take part in the first step
            for name, parameter in job.adapter.named_parameters():
                if name.endswith("lora_B.weight"):
                    parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(index)))
        trainer.add_job(job)
    return [result.loss for result in trainer.train_step().results]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_a_fused_moe_step_gives_each_job_its_loss_alone(device):
    fused = first_step_losses(device, [0, 1, 2])
    alone = [first_step_losses(device, [index])[0] for index in range(3)]
    if device == "cpu":
        assert fused == alone
        return
    terms = llama_chain_terms(build_config("qwen3_moe"), sequence=64, tokens=300, backward=False)
    for got, expected in zip(fused, alone, strict=True):
        assert abs(got - expected) <= rounding_tolerance(terms, abs(expected)), (got, expected)
