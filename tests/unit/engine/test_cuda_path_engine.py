"""The CUDA path's whole engine, run on the CPU, as a trainer loop drives it: jobs joining between steps, leaving
once done, accumulating over steps, and a job checkpointed mid-accumulation and resumed alone. Every switch of the
path is on (tests/helpers/cuda_path_runs.py `on_the_cuda_path`): adapters in the base's dtype on their segments with
their float32 masters pooled (one flat tensor a job, gradients added into its flat buffer), per segment or by
grouped_mm over stacks kept between steps; the optimizer steps on the device (the flat AdamW: one pass over a job's
pool, norms kept on the device, one read-back a step); the next step's batch packed during this one. What the
path keeps from step to step (a layer's jobs and routes, the stacks, the pools, the flat moments, the prepacked
batch) must follow the jobs as they come and go, and a checkpoint must carry the flat state.

Reference: each job trained alone through the same path, and the resumed job's uninterrupted run. Equality is
exact, as tests/unit/engine/test_isolation.py argues for the fused step on a CPU (each job's products read its own
rows only; MKL's float32 and oneDNN's bfloat16 products round each element by the inner dimension alone), and as
test_checkpoint.py argues for a resume: the same arithmetic on the same state. A cache that outlived its job, a
pool's buffer not cleared, a moment not restored would show as a difference. The kernels' own arithmetic (Triton's,
on a GPU) against these references: test_engine_kernels_interpreted.py and tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.engine.generate import greedy_generate_many
from actors.engine.job import TrainingJob
from actors.engine.trainer import FusedTrainer
from tests.helpers.cuda_path_runs import PlannedJob, assert_as_alone, on_the_cuda_path, planned_jobs, run_planned
from tests.helpers.isolation import base_for

PATHS = [("bfloat16", "segments"), ("bfloat16", "grouped_mm"), ("float32", "segments")]


@pytest.mark.parametrize("config,kernel", PATHS)
def test_jobs_joining_leaving_and_accumulating_on_the_cuda_path_end_as_alone(monkeypatch, config, kernel):
    calls = on_the_cuda_path(monkeypatch, kernel)
    base = base_for(config)
    planned = planned_jobs()
    fused_weights, fused_losses, steps = run_planned(base, planned)
    assert steps == 6   # the plan (`planned_jobs`): "late" and "accumulating" end at step 6, "after" with them
    assert calls.layers > 0, "the CUDA path was not taken"
    assert kernel == "segments" or calls.kept_stacks > 0, "no stacks were kept between steps: grouped_mm's not tested"
    assert calls.flat_updates == sum(job.spec.max_steps for job in planned), "the flat AdamW did not step every job"
    assert_as_alone(base, planned, fused_weights, fused_losses)


@pytest.mark.parametrize("config,kernel", PATHS[:2])
def test_evaluations_and_continuations_between_steps_leave_the_jobs_as_alone(monkeypatch, config, kernel):
    """After every fused step each job is evaluated (a no-grad forward of its eval rows through its adapter, in
    evaluation mode) and one continues a prompt (the generation path: a batch of its adapter and the base alone,
    token by token with the key-value cache), as a trainer loop does between steps for `eval_every` and "try it".
    Neither may leave anything the next training step reads (an adapter's mode, a cast, a kept stack, a layer's
    routes, a packed batch): each job still ends exactly as it does alone, without them."""
    calls = on_the_cuda_path(monkeypatch, kernel)
    base = base_for(config)
    planned = planned_jobs()
    evaluations, continuations = [], []

    def evaluate_and_continue(trainer, jobs):
        for name, job in jobs.items():
            evaluations.append(trainer.evaluate(job, job.eval_examples or planned_examples[name][:4]))
        name = sorted(jobs)[-1]
        continuations.append(greedy_generate_many(base, [(name, [5, 9, 13]), (None, [5, 9, 13])], 4, set()))

    planned_examples = {job.spec.name: job.examples for job in planned}
    fused_weights, fused_losses, steps = run_planned(base, planned, between_steps=evaluate_and_continue)
    # every job on the trainer took part in every step (one micro-batch each): one evaluation a job and step
    assert len(continuations) == steps and len(evaluations) == sum(len(x) for x in fused_losses.values())
    assert all(len(tokens) == 4 for pair in continuations for tokens in pair)
    assert calls.kept_stacks > 0 or kernel == "segments"
    assert_as_alone(base, planned, fused_weights, fused_losses)


@pytest.mark.parametrize("config,kernel", PATHS[:2])
def test_a_job_checkpointed_mid_accumulation_on_the_cuda_path_resumes_to_its_uninterrupted_end(
        monkeypatch, tmp_path, config, kernel):
    """Checkpointed after 3 micro-batches (its first optimizer step taken by the flat AdamW, the next accumulation
    half done) beside a neighbour, resumed alone in a new trainer: its losses and final adapter are those of its
    uninterrupted run. The checkpoint reads the flat moments through torch's state (each parameter's count brought up
    to date); the resumed job's flat step adopts the loaded state."""
    calls = on_the_cuda_path(monkeypatch, kernel)
    base = base_for(config)
    accumulating, neighbour = planned_jobs()[1], planned_jobs()[2]
    uninterrupted, losses, _ = run_planned(base, [PlannedJob(accumulating.spec, accumulating.examples, 1)])
    name = accumulating.spec.name

    trainer = FusedTrainer(base, step_tokens=100_000)
    trainer.batches.ahead = True
    job = TrainingJob.create(accumulating.spec, base, accumulating.examples, [], seed=1)
    trainer.add_job(job)
    trainer.add_job(TrainingJob.create(neighbour.spec, base, neighbour.examples, [], seed=2))
    before = calls.flat_updates
    for _ in range(3):
        trainer.train_step()
    assert job.step == 1 and job.accumulator.micro_batches == 1
    assert calls.flat_updates - before == 1 + 3   # its first step and the neighbour's three
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    for other in list(trainer.jobs):
        trainer.remove_job(other)

    trainer = FusedTrainer(base, step_tokens=100_000)
    trainer.batches.ahead = True
    resumed = TrainingJob.create(accumulating.spec, base, accumulating.examples, [], seed=1)
    load_checkpoint(resumed, tmp_path / "ckpt")
    trainer.add_job(resumed)
    resumed_losses = []
    while not resumed.done:
        resumed_losses += [result.loss for result in trainer.train_step().results]
    assert losses[name][3:] == resumed_losses
    for key, value in uninterrupted[name].items():
        got = dict(resumed.adapter.named_parameters())[key].detach()
        assert torch.equal(got, value), (key, float((got.float() - value.float()).abs().max()))
    trainer.remove_job(name)
