"""`compile: graphs` on a GPU (actors/engine/step_graphs.py): a tiny Llama in bfloat16, two jobs whose micro-batches
change length every step, one accumulating gradients over two micro-batches, at a real learning rate, an evaluation
between two steps; after the warm-up the steps are replays of captured CUDA graphs, and each replay is checked
against the same step run eagerly from the same state (tests/helpers/graph_check.py: the replay first, so that the
eager step's refreshes cannot hide one the graph lacks). The CPU tests (tests/unit/engine/test_step_graphs.py) make
the same check bit for bit on a stand-in; this one the real capture: it fails with the capture's error where one
operation of the step cannot be captured.

The bounds. The forward's kernels are the same in both runs and deterministic except the per-job loss sums
(`index_add_`: float32 atomic additions in any order), so a job's loss, a mean of at most `tokens` positive terms,
differs by at most (tokens - 1) x 2**-24 of itself. The backward's flash-attention kernel adds the query gradients
by float32 atomics and rounds them to bfloat16, so the gradients may differ by bfloat16 roundings carried through
the layers: at most a few bfloat16 ulps (2**-8) of the job's largest gradient, taken here as 2**-5. A replay of last
step's inputs, tables or weights differs from the eager step by far more (a step's update at this learning rate
moves the losses by ~1e-3 of themselves, the CPU test's stale case 6e-3), and a lost gradient view by the whole
gradient."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 16   # the warm-up (2 eager steps a shape, and until the LoRA products' kernels are measured), a growth
AFTER_EVALUATION = 6
GRADIENT_BOUND = 2.0**-5


def test_every_replayed_step_equals_the_same_step_run_eagerly(monkeypatch):
    from actors.engine import graphed_steps, lora_stacks
    from actors.engine.job import TrainingJob
    from actors.engine.models import from_module
    from actors.engine.trainer import FusedTrainer
    from tests.helpers.fused import VOCAB, job_spec
    from tests.helpers.graph_check import CheckedGraphs
    from tests.helpers.models import random_examples, tiny_model

    monkeypatch.setattr(graphed_steps, "StepGraphs", CheckedGraphs)
    gc.collect()   # earlier tests' models, whose layers' kept stacks a collection inside this test would free
    base = from_module(tiny_model("llama", VOCAB).to("cuda", torch.bfloat16), None)
    trainer = FusedTrainer(base, step_tokens=100_000, compile="graphs")
    jobs = [(job_spec("a", max_steps=50, grad_accum=2, lora={"r": 16, "alpha": 32, "target_modules": "all-linear"}),
             0),
            (job_spec("b", max_steps=50, batch_size=2,
                      lora={"r": 16, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}), 1)]   # stacks kept
    for spec, seed in jobs:
        job = TrainingJob.create(spec, base, random_examples(seed, count=64, vocab=VOCAB, max_len=48), [], seed=seed)
        trainer.add_job(job)
        with torch.no_grad():   # B away from its zero start, so that every gradient is exercised
            for name, parameter in job.adapter.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(std=0.1, generator=torch.Generator(device="cuda").manual_seed(seed))
    for _ in range(STEPS):
        trainer.train_step()
    captured, version = trainer.graphs.captures, lora_stacks.KEPT.version
    # an evaluation between steps replaces the layers' kept stacks the graph reads: the next step is captured again
    trainer.evaluate(trainer.jobs["a"], random_examples(7, count=8, vocab=VOCAB, max_len=48), batch_size=4)
    assert lora_stacks.KEPT.version != version
    for _ in range(AFTER_EVALUATION):
        trainer.train_step()

    graphs = trainer.graphs
    assert graphs.captures > captured >= 1, (captured, graphs.captures)
    failed = [entry.failed for entry in graphs.entries.values() if entry.failed]
    assert not failed, f"the step could not be captured: {failed}"
    assert graphs.captures >= 1 and len(graphs.checks) >= 6, (graphs.captures, graphs.replays, len(graphs.checks))
    # each graph's pool measured at its capture (what the memory plan holds beside other steps)
    assert all(entry.held > 0 for entry in graphs.entries.values() if entry.graph is not None)
    tokens = max(shape.tokens for shape in graphs.shapes.values())
    loss_bound = (tokens - 1) * 2.0**-24
    for index, check in enumerate(graphs.checks):
        assert check.largest_loss_difference() <= loss_bound, (index, check.losses, loss_bound)
        assert check.largest_gradient_difference() <= GRADIENT_BOUND, (index, check.largest_gradient_difference())
        assert all(float(eager.abs().max()) > 0 for _, eager in check.gradients), index
