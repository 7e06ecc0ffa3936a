"""Pipeline trainers (a base cut into stages, each stage its own process, over torch.distributed's gloo)
against the independent reference, the single-device fused trainer: every job ends with the same adapter,
bit for bit, the same micro-batch losses and the same optimizer-step records (loss, lr, gradient norm), on
2 and 3 stages, with several jobs in flight, gradient accumulation, clipping, dropout, DoRA, PiSSA, LoRA+,
ORPO, recomputation; jobs joining and leaving mid-run; a job resumed from its state; a stage killed.

Why bit for bit: a stage runs the model's own decoder forward on its layers (actors/engine/pipeline/
stage_model.py) over the same packed stream, every job's arithmetic is its own (test_isolation.py), a job's
micro-batches keep their order at every stage, its gradient norm is summed in the same order
(optim.chained_sum) and its dropout generator's state moves with its activations. Each process computes
with one thread, the reference too (an SVD's or a reduction's rounding may depend on the thread count)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.spec import JobSpec
from actors.service.pipeline_processes import LocalPipeline
from tests.helpers.fused import job_spec
from tests.helpers.models import random_examples
from tests.helpers.pairs import random_pairs
from tests.helpers.pipeline import VOCAB, background, loader, single_device, tiny_base

LAYERS = 5


def sft(name: str, index: int, steps: int = 4, **overrides):
    lora = {"target_modules": "all-linear", "r": 4, "alpha": 8, **overrides.pop("lora", {})}
    spec = job_spec(name, batch_size=overrides.pop("batch_size", 2), max_steps=steps, lora=lora, **overrides)
    return spec, random_examples(index, count=12, vocab=VOCAB, min_len=5, max_len=30), index


def mixed_jobs(prefix: str) -> list[tuple[JobSpec, list, int]]:
    return [
        sft(f"{prefix}plain", 0),
        sft(f"{prefix}accum", 1, batch_size=3, grad_accum=2, max_grad_norm=0.05, lora={"r": 8, "alpha": 16}),
        sft(f"{prefix}dropout", 2, lora={"dropout": 0.2, "target_modules": ["v_proj", "q_proj"], "r": 2}),
        sft(f"{prefix}dora", 3, lora={"use_dora": True, "dropout": 0.1}),
        sft(f"{prefix}pissa", 4, lora={"init_lora_weights": "pissa"}, max_grad_norm=0.1),
        sft(f"{prefix}plus", 5, lora={"loraplus_lr_ratio": 4.0}, lr_schedule="linear"),
        (JobSpec(name=f"{prefix}orpo", data="unused.jsonl", format={"type": "preference"}, method="orpo",
                 batch_size=2, grad_accum=2, max_steps=2, lr=5e-3, lora={"r": 4, "alpha": 8}), random_pairs(6, 10), 6),
    ]


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=[2, 3], ids=["2-stages", "3-stages"])
def pipeline(request, one_thread):
    with LocalPipeline(loader(layers=LAYERS), request.param, split="even", threads=1) as running:
        background(running)
        yield running


def train_on(pipeline: LocalPipeline, jobs, **run) -> dict[str, dict]:
    for spec, examples, seed in jobs:
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(**run)
    return {spec.name: pipeline.remove_job(spec.name) | {"job": pipeline.trainer.jobs.get(spec.name)}
            for spec, _, _ in jobs}


def assert_same_as_single_device(states: dict[str, dict], heads: dict, jobs, reference=None) -> None:
    weights, losses, history = reference or single_device(tiny_base(layers=LAYERS), jobs)
    moved = 0.0
    for spec, _, _ in jobs:
        name = spec.name
        assert heads[name].losses == losses[name], name
        ours = [(r.step, r.loss, r.lr, r.grad_norm, r.tokens, r.metrics) for r in heads[name].history]
        theirs = [(r.step, r.loss, r.lr, r.grad_norm, r.tokens, r.metrics) for r in history[name]]
        assert ours == theirs, name
        assert set(states[name]["tensors"]) >= set(weights[name])
        for key, value in weights[name].items():
            assert torch.equal(states[name]["tensors"][key], value), (name, key)
        moved = max(moved, max(float(v.abs().max()) for k, v in weights[name].items() if "lora_B" in k))
    assert moved > 0, "no adapter trained: nothing was compared"


def run_and_keep_heads(pipeline: LocalPipeline, jobs, **run):
    for spec, examples, seed in jobs:
        pipeline.add_job(spec, examples, seed=seed)
    pipeline.run(**run)
    heads = {spec.name: pipeline.trainer.jobs[spec.name] for spec, _, _ in jobs}
    states = {spec.name: pipeline.remove_job(spec.name) for spec, _, _ in jobs}
    return states, heads


def test_every_kind_of_job_trains_exactly_as_on_one_device(pipeline):
    jobs = mixed_jobs("mix-")
    states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs)
    stats = pipeline.stats()
    assert len(stats) == pipeline.trainer.stages and all(s["busy_s"] > 0 for s in stats)
    whole = sum(p.numel() * p.element_size() for p in tiny_base(layers=LAYERS).model.parameters())
    assert sum(s["weight_bytes"] for s in stats) < 1.5 * whole   # each stage holds its share (+ small shared parts)


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


def preference_job(name: str, method: str, index: int, **overrides):
    spec = JobSpec(name=name, data="unused.jsonl", format={"type": "preference"}, method=method, batch_size=2,
                   lr=5e-3, lora={"r": 4, "alpha": 8}, **{"max_steps": 3, **overrides})
    return spec, random_pairs(index, 6), index


def test_dpo_jobs_take_their_references_through_the_stages_exactly(pipeline):
    """DPO's reference is the base alone: the pairs not yet cached go through every stage with no adapter
    before their micro-batch, the last stage keeps them; pairs seen again (a second epoch) come from there."""
    jobs = [preference_job("dpo-a", "dpo", 60, max_steps=None, epochs=2),
            preference_job("dpo-b", "dpo", 61, grad_accum=2, max_grad_norm=0.5),
            sft("dpo-neighbour", 62)]
    states, heads = run_and_keep_heads(pipeline, jobs)
    assert_same_as_single_device(states, heads, jobs)


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
