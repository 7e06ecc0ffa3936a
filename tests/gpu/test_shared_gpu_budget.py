"""A trainer holding a share of a GPU (`num_gpus` below 1: several trainers on one card) plans its steps within
that share of the card's default budget, not within 90% of the whole card as each of them did (CUDA only: the
budget is the card's)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("num_gpus", [0.25, 1.0])
def test_a_trainer_on_a_share_of_a_gpu_plans_within_that_share(num_gpus):
    from actors.engine.models import from_module
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.trainer.loop_steps import admitted_engine
    from tests.helpers.fused import VOCAB
    from tests.helpers.models import tiny_model

    base = from_module(tiny_model("llama", VOCAB).to("cuda", torch.bfloat16), None)
    config = TrainerConfig(base_model="smollm2-135m", num_gpus=num_gpus, step_tokens=512)
    _, admission, again = admitted_engine(base, config, None, None)
    card = torch.cuda.get_device_properties(base.device).total_memory
    assert admission.budget == int(card * 0.9 * num_gpus)
    assert again().budget == admission.budget   # as made again after a pipeline's new stages
    assert admitted_engine(base, TrainerConfig(num_gpus=num_gpus, memory_budget_bytes=2**30), None,
                           None)[1].budget == 2**30   # a budget given is the budget
