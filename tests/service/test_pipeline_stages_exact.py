"""The same exactness on 3 stages (a first stage that embeds, a middle one that neither embeds nor scores, a
last one that scores: every link a 2-stage pipeline has, and one more): every kind of job, and DPO's
references through the stages. The reference and the reasons: tests/service/test_pipeline_trainer.py, whose
2-stage pipeline runs the other tests."""

from __future__ import annotations

import pytest

from tests.helpers.pipeline import (
    LAYERS,
    assert_same_as_single_device,
    mixed_jobs,
    preference_job,
    run_and_keep_heads,
    running_pipeline,
    sft,
    tiny_base,
)


@pytest.fixture(scope="module")
def pipeline():
    yield from running_pipeline(3)


def test_every_kind_of_job_trains_exactly_as_on_one_device(pipeline):
    jobs = mixed_jobs("mix-")
    states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs)
    stats = pipeline.stats()
    assert len(stats) == pipeline.trainer.stages and all(s["busy_s"] > 0 for s in stats)
    whole = sum(p.numel() * p.element_size() for p in tiny_base(layers=LAYERS).model.parameters())
    assert sum(s["weight_bytes"] for s in stats) < 1.5 * whole   # each stage holds its share (+ small shared parts)


def test_dpo_jobs_take_their_references_through_the_stages_exactly(pipeline):
    """DPO's reference is the base alone: the pairs not yet cached go through every stage with no adapter
    before their micro-batch, the last stage keeps them; pairs seen again (a second epoch) come from there."""
    jobs = [preference_job("dpo-a", "dpo", 60, max_steps=None, epochs=2),
            preference_job("dpo-b", "dpo", 61, grad_accum=2, max_grad_norm=0.5),
            sft("dpo-neighbour", 62)]
    states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs)
