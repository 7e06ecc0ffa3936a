"""`compile: graphs` on a GPU (actors/engine/step_graphs.py): a tiny Llama in bfloat16, two jobs whose micro-batches
change length every step; after the warm-up the steps are replays of one captured CUDA graph, and each step's
losses and gradient norms equal the same steps run eagerly in their fixed shapes (tests/helpers/graph_replay.py's
`WarmOnly`), to the order of the device's atomic additions (the per-job loss sums: float32, a few ulps). The weights
barely move (lr 1e-9), so the two runs see the same weights: a replay that read stale inputs (last step's tokens or
bounds) or lost its gradient views would be off by far more. The CPU tests (tests/unit/engine/test_step_graphs.py)
compare a stand-in's replay bit for bit; this one the real capture: it fails with the capture's error where one
operation of the step cannot be captured."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 16   # the warm-up (2 eager steps a shape, and until the LoRA products' kernels are measured), a growth


def _run(model, backend) -> tuple[list, list, object]:
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.models import random_examples

    base = from_module(copy.deepcopy(model), None)
    trainer = FusedTrainer(base, step_tokens=100_000, compile="graphs", graph_backend=backend)
    jobs = [(job_spec("a", lr=1e-9, max_steps=50, lora={"r": 16, "alpha": 32, "target_modules": "all-linear"}), 0),
            (job_spec("b", lr=1e-9, max_steps=50, batch_size=2,
                      lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}), 1)]
    for spec, seed in jobs:
        job = TrainingJob.create(spec, base, random_examples(seed, count=64, vocab=VOCAB, max_len=48), [], seed=seed)
        trainer.add_job(job)
        with torch.no_grad():   # B away from its zero start, so that every gradient is exercised
            for name, parameter in job.adapter.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1, generator=torch.Generator(device="cuda").manual_seed(seed))
    losses, norms = [], []
    for _ in range(STEPS):
        report = trainer.train_step()
        losses.append([result.loss for result in report.results])
        norms.append([result.optimizer_step.grad_norm for result in report.results])
    return losses, norms, trainer


def test_replayed_steps_equal_the_same_steps_run_eagerly():
    from actors.engine import step_graphs
    from tests.helpers.fused import VOCAB
    from tests.helpers.graph_replay import WarmOnly
    from tests.helpers.models import tiny_model

    model = tiny_model("llama", VOCAB).to("cuda", torch.bfloat16)
    losses, norms, trainer = _run(model, None)   # CUDA graphs
    failed = [entry.failed for entry in trainer.graphs.entries.values() if entry.failed]
    assert not failed, f"the step could not be captured: {failed}"
    assert trainer.graphs.captures >= 1 and trainer.graphs.replays >= 6, (trainer.graphs.captures,
                                                                          trainer.graphs.replays)
    saved = step_graphs.WARMUP
    step_graphs.WARMUP = 10**9
    try:
        eager_losses, eager_norms, _ = _run(model, WarmOnly())
    finally:
        step_graphs.WARMUP = saved
    for step, (got, expected) in enumerate(zip(losses, eager_losses, strict=True)):
        assert got == pytest.approx(expected, rel=1e-5), step
    for step, (got, expected) in enumerate(zip(norms, eager_norms, strict=True)):
        assert got == pytest.approx(expected, rel=1e-3), step
