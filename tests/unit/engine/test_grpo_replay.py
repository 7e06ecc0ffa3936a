"""GRPO's num_iterations (actors/engine/grpo_replay.py): a generation (one optimizer step's micro-batches of
completions) is sampled once and trained on for num_iterations optimizer steps, the later ones against the
log-probabilities the completions had at their first (the loss itself against TRL's: test_grpo.py's `replayed`
cases); an epochs budget counts each generation's steps, a last generation cut short by the data's end included; a
job interrupted mid-replay, mid-accumulation, resumes from its checkpoint to exactly the uninterrupted adapter; the
job fused beside others trains exactly as alone; a checkpoint's replay that does not fit the job is refused."""

from __future__ import annotations

import json

import pytest
import torch

import actors.engine.grpo as grpo
from actors.checkpoint import load_checkpoint, save_checkpoint
from actors.engine.job import TrainingJob
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec, planned_steps
from tests.helpers.grpo_jobs import grpo_spec, number_base, prompt_rows
from tests.helpers.isolation import VOCAB, assert_isolated
from tests.helpers.models import random_examples


def _spec(iterations: int, **changes) -> JobSpec:
    settings = {"reward": "tests.helpers.rewards:shorter", "num_generations": 4, "max_new_tokens": 5,
                "num_iterations": iterations, "epsilon": 0.1, "epsilon_high": 0.15}
    return grpo_spec("grpo", "tests.helpers.rewards:shorter", grpo=settings, **{"grad_accum": 2, "lr": 5e-2,
                                                                                 **changes})


def _weights(job: TrainingJob) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in job.adapter.named_parameters()}


def test_each_generation_is_sampled_once_and_trained_on_num_iterations_times(monkeypatch):
    sampled = []
    original = grpo.greedy_generate_many
    monkeypatch.setattr(grpo, "greedy_generate_many", lambda *a, **k: sampled.append(1) or original(*a, **k))
    base = number_base()
    trainer = FusedTrainer(base)
    job = TrainingJob.create(_spec(3, max_steps=6), base, prompt_rows(0, 8), [], seed=0)
    trainer.add_job(job)
    steps = []
    while (report := trainer.train_step()) is not None:
        steps.append((job.step, report.results[0].optimizer_step is not None))
    assert job.step == 6 and len(job.history) == 6
    assert len(sampled) == 2 * 2   # two generations of two micro-batches each
    assert len(steps) == 6 * 2     # every optimizer step over both micro-batches
    rows = [record.as_row() for record in job.history]
    assert all(row["clip_ratio/region_mean"] == 0 for row in rows[0::3])   # a generation's first step: ratios of 1
    assert any(row["clip_ratio/region_mean"] > 0 for row in rows[1::3] + rows[2::3]), rows   # later: they moved
    for first in (0, 3):   # a generation's steps train on the same completions: the same rewards
        assert rows[first]["reward"] == rows[first + 1]["reward"] == rows[first + 2]["reward"]
    assert rows[0]["reward"] != rows[3]["reward"]   # a new generation: new completions


def test_an_epochs_budget_counts_each_generations_steps_the_last_cut_short_included():
    spec = _spec(2, max_steps=None, epochs=1.0)   # 6 rows of 2: 3 micro-batches, the last generation has one
    assert planned_steps(spec, 6) == 2 * 2
    base = number_base()
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec, base, prompt_rows(0, 6), [], seed=0)
    trainer.add_job(job)
    micro_batches = 0
    while trainer.train_step() is not None:
        micro_batches += 1
    assert job.done and job.step == 4 and micro_batches == 2 + 2 + 1 + 1


def test_a_job_interrupted_mid_replay_resumes_to_the_uninterrupted_adapter(tmp_path):
    """Checkpointed after a generation's first optimizer step and one micro-batch of its replay, beside an SFT job,
    then resumed alone: the same adapter and losses, bit for bit (as test_checkpoint.py's resumed SFT job)."""
    base = number_base()
    data = prompt_rows(0, 8)
    uninterrupted_trainer = FusedTrainer(base)
    uninterrupted = TrainingJob.create(_spec(3, max_steps=6), base, data, [], seed=0)
    uninterrupted_trainer.add_job(uninterrupted)
    while uninterrupted_trainer.train_step() is not None:
        pass
    expected, losses = _weights(uninterrupted), [r.loss for r in uninterrupted.history]
    uninterrupted_trainer.remove_job("grpo")

    trainer = FusedTrainer(base)
    job = TrainingJob.create(_spec(3, max_steps=6), base, data, [], seed=0)
    trainer.add_job(job)
    trainer.add_job(TrainingJob.create(JobSpec(name="sft", data="unused.jsonl", format={"type": "text"},
                                               batch_size=2, max_steps=6), base,
                                       random_examples(1, count=6, vocab=VOCAB), [], seed=1))
    for _ in range(3):   # the generation's two micro-batches (one optimizer step), then one replayed
        trainer.train_step()
    assert job.step == 1 and job.replaying and job.replay.position == 1 and job.accumulator.micro_batches == 1
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    saved = json.loads((tmp_path / "ckpt" / "state.json").read_text())["replay"]
    assert saved["iteration"] == 1 and saved["position"] == 1 and len(saved["batches"]) == 2
    for name in list(trainer.jobs):
        trainer.remove_job(name)

    trainer = FusedTrainer(base)
    resumed = TrainingJob.create(_spec(3, max_steps=6), base, data, [], seed=0)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert resumed.replaying and resumed.replay.position == 1
    trainer.add_job(resumed)
    while trainer.train_step() is not None:
        pass
    assert [r.loss for r in resumed.history] == losses
    final = _weights(resumed)
    assert all(torch.equal(final[name], expected[name]) for name in expected)
    assert any(float(v.abs().max()) > 0 for name, v in expected.items() if "lora_B" in name)
    trainer.remove_job("grpo")

    refused = TrainingJob.create(_spec(1, max_steps=6), base, data, [], seed=0)   # its spec replays nothing
    with pytest.raises(Exception, match="replay is at iteration 1, but the job's grpo.num_iterations is 1"):
        load_checkpoint(refused, tmp_path / "ckpt")


def test_a_replaying_grpo_job_fused_with_an_sft_job_trains_exactly_as_alone():
    jobs = [(_spec(2, max_steps=4), prompt_rows(0, 8), 0),
            (JobSpec(name="sft", data="unused.jsonl", format={"type": "text"}, batch_size=3, max_steps=4, lr=1e-2,
                     lora={"r": 4, "alpha": 8, "target_modules": "all-linear"}),
             random_examples(1, count=6, vocab=VOCAB), 1)]
    assert_isolated(number_base(), jobs)


def test_a_replaying_grpo_job_runs_through_the_in_process_service(tiny_model_dirs, tmp_path):
    """The service's trainer loop composes, samples and replays as the engine does: the job completes its steps,
    each generation's later steps report their clip ratios, and its rows are in the job's metrics.jsonl."""
    from pathlib import Path

    from actors.service.scheduler.local_run import train_locally
    from actors.spec.run_spec import RunSpec
    from tests.helpers.service import job_dict, write_task_data

    data = write_task_data(tmp_path / "data", "arith")
    job = job_dict("grpo", data, 4, method="grpo", batch_size=2, grad_accum=2, max_seq_len=64,
                   grpo={"reward": "contains", "num_generations": 3, "max_new_tokens": 6, "num_iterations": 2})
    spec = RunSpec(base_model=str(tiny_model_dirs["llama"]), output_dir=tmp_path / "runs", step_tokens=2048,
                   jobs=[job, job_dict("sft", data, 3)])
    results = {r.name: r for r in train_locally(spec, progress=False)}
    assert results["grpo"].state == "completed" and results["grpo"].steps == 4, results["grpo"].reason
    assert results["sft"].state == "completed", results["sft"].reason
    rows = [json.loads(line) for line in (Path(results["grpo"].adapter_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["reward"] == rows[3]["reward"]   # replayed generations
    assert all(row["clip_ratio/region_mean"] == 0 for row in rows[0::2])   # a generation's own step: ratios of 1
