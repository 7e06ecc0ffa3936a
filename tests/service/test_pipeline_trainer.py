"""Pipeline trainers (a base cut into stages, each stage its own process, over torch.distributed's gloo)
against the independent reference, the single-device fused trainer: every job ends with the same adapter,
bit for bit, the same micro-batch losses and the same optimizer-step records (loss, lr, gradient norm), on
2 stages (and 3: test_pipeline_stages_exact.py), with several jobs in flight: jobs joining and leaving
mid-run, a job resumed from its state, evaluation; every kind of job and DPO: test_pipeline_stages_exact.py;
recomputation and a stage killed: test_pipeline_faults.py.

Why bit for bit: a stage runs the model's own decoder forward on its layers (actors/engine/pipeline/
stage_model.py) over the same packed stream, every job's arithmetic is its own (test_isolation.py), a job's
micro-batches keep their order at every stage, its gradient norm is summed in the same order
(joint_steps.chained_sum) and its dropout generator's state moves with its activations. Each process computes
with one thread, the reference too (an SVD's or a reduction's rounding may depend on the thread count)."""

from __future__ import annotations

import pytest

from tests.helpers.models import random_examples
from tests.helpers.pairs import random_pairs
from tests.helpers.pipeline import (
    LAYERS,
    VOCAB,
    assert_same_as_single_device,
    preference_job,
    running_pipeline,
    sft,
    tiny_base,
)


@pytest.fixture(scope="module")
def pipeline():
    yield from running_pipeline(2)


def test_jobs_joining_and_leaving_mid_run_change_no_other_job(pipeline):
    stay = [sft("stay-a", 10), sft("stay-b", 11, grad_accum=2, lora={"dropout": 0.1})]
    late = [sft("late", 12)]
    leaver = sft("leaver", 13, steps=6)
    for spec, examples, seed in stay + [leaver]:
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(max_plans=3)
    spec, examples, seed = late[0]
    pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(max_plans=2)
    left = pipeline.remove_job("leaver")     # cancelled mid-run: its state as of its last step
    assert 0 < left["step_count"] < 6
    pipeline.run()
    heads = {spec.name: pipeline.trainer.jobs[spec.name] for spec, _, _ in stay + late}
    states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in stay + late}
    assert_same_as_single_device(states, heads, stay + late)


def test_a_job_resumed_from_its_state_ends_as_the_uninterrupted_one(pipeline):
    jobs = [sft("resumed", 20, steps=6, lora={"dropout": 0.1}, max_grad_norm=0.5), sft("neighbour", 21, steps=6)]
    for spec, examples, seed in jobs:
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(max_plans=4)
    before = pipeline.trainer.jobs["resumed"]
    state = pipeline.remove_job("resumed")
    assert 0 < state["step_count"] < 6 and state["moments"]
    spec, examples, seed = jobs[0]
    pipeline.add_job(spec, examples, seed=seed, state=state)
    pipeline.run()
    after = pipeline.trainer.jobs["resumed"]
    after.losses[:0] = before.losses          # the run's losses: before the pause, then after
    heads = {"resumed": after, "neighbour": pipeline.trainer.jobs["neighbour"]}
    states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in jobs}
    assert_same_as_single_device(states, heads, jobs)


def test_a_job_added_twice_is_refused_and_the_pipeline_goes_on(pipeline):
    spec, examples, seed = sft("twice", 90, steps=2)
    pipeline.add_job(spec, examples, seed=seed)
    with pytest.raises(ValueError, match="job 'twice' is already on this pipeline"):
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run()
    assert len(pipeline.trainer.jobs["twice"].history) == 2
    pipeline.remove_job("twice")


def test_evaluation_equals_the_single_device_trainers(pipeline):
    from actors.engine.job import TrainingJob
    from actors.engine.trainer import FusedTrainer
    jobs = [sft("eval-sft", 70, lora={"dropout": 0.1}), preference_job("eval-orpo", "orpo", 71),
            preference_job("eval-dpo", "dpo", 72)]
    evals = {spec.name: (random_pairs(80 + seed, 5) if spec.method != "sft"
                         else random_examples(80 + seed, count=5, vocab=VOCAB, min_len=5, max_len=30))
             for spec, _, seed in jobs}
    base = tiny_base(layers=LAYERS)
    trainer = FusedTrainer(base, step_tokens=100_000)
    created = [TrainingJob.create(spec, base, examples, evals[spec.name], seed=seed) for spec, examples, seed in jobs]
    for job in created:
        trainer.add_job(job)
    before = {job.name: trainer.evaluate(job, batch_size=2) for job in created}
    while trainer.train_step() is not None:
        pass
    after = {job.name: trainer.evaluate(job, batch_size=2) for job in created}
    for spec, examples, seed in jobs:
        pipeline.add_job(spec, examples, seed=seed, eval_examples=evals[spec.name])
    assert {spec.name: pipeline.trainer.evaluate(spec.name, batch_size=2) for spec, _, _ in jobs} == before
    pipeline.run()
    assert {spec.name: pipeline.trainer.evaluate(spec.name, batch_size=2) for spec, _, _ in jobs} == after
    assert after != before
    for spec, _, _ in jobs:
        pipeline.remove_job(spec.name)
