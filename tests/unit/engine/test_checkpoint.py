"""Checkpoint and resume against an uninterrupted run: same final adapter, mid-accumulation included;
format 2 (safetensors + JSON) restores the optimizer exactly; format 1 (optimizer.pt) is still read, with
torch.load(weights_only=True) only."""

from __future__ import annotations

import copy
import dataclasses
import json

import torch

from actors.checkpoint import LoadedCheckpoint, has_checkpoint, load_checkpoint, save_checkpoint
from actors.engine.adapter_surgery import remove_adapter
from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.trainer import FusedTrainer
from actors.spec.job_spec import JobSpec
from tests.helpers.checkpoints import VOCAB, spec, weights, write_format_1
from tests.helpers.models import random_examples, tiny_model

FORMAT_2_FILES = ["adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "state.json"]


def neighbour() -> JobSpec:
    return JobSpec(name="neighbour", data="x", format={"type": "text"}, batch_size=2, max_steps=30)


def training_state(job: TrainingJob) -> dict:
    """Everything a checkpoint must restore exactly, beyond the adapter weights."""
    generator = job.adapter.dropout_generator
    return {"optimizer": copy.deepcopy(job.optimizer.optimizer.state_dict()),
            "counts": (job.optimizer.step_count, job.optimizer.micro_count),
            "gradients": [None if p.grad is None else p.grad.detach().clone() for p in job.adapter.parameters()],
            "dropout_rng": None if generator is None else generator.get_state().clone()}


def assert_same_training_state(actual: dict, expected: dict) -> None:
    assert actual["counts"] == expected["counts"]
    assert actual["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
    for got, want in zip(actual["optimizer"]["param_groups"], expected["optimizer"]["param_groups"], strict=True):
        assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}  # betas a tuple
    assert actual["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()
    for param_id, entries in expected["optimizer"]["state"].items():
        assert actual["optimizer"]["state"][param_id].keys() == entries.keys()
        for key, value in entries.items():
            got = actual["optimizer"]["state"][param_id][key]
            assert got.dtype == value.dtype and got.device == value.device and torch.equal(got, value), key
    assert len(actual["gradients"]) == len(expected["gradients"])
    for got, want in zip(actual["gradients"], expected["gradients"], strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert torch.equal(got, want)
    assert torch.equal(actual["dropout_rng"], expected["dropout_rng"])


def uninterrupted_run(base, data) -> tuple[dict, list[float]]:
    """The job trained to its end without a break: its adapter weights and its losses (the reference)."""
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, [], seed=0)
    trainer.add_job(job)
    while not job.done:
        trainer.train_step()
    result = weights(job), [r.loss for r in job.history]
    trainer.remove_job(job.name)
    return result


def test_resumed_job_ends_with_the_uninterrupted_adapter(tmp_path):
    """Interrupted mid-accumulation beside a neighbour job and resumed alone, the job ends with exactly the
    uninterrupted run's adapter and losses: the same arithmetic on the same state. A fused step computes a
    job's tokens as its solo step does, bit for bit on the CPU (tests/unit/engine/test_isolation.py says why), and the
    checkpoint restores every bit the next steps read (the adapter, AdamW's moments and step, the partial
    gradients, the dropout generator, the data position: `assert_same_training_state`), so no rounding
    differs: equality, not a tolerance."""
    base = from_module(tiny_model("llama", VOCAB), None)
    data = random_examples(0, count=10, vocab=VOCAB)
    other_data = random_examples(1, vocab=VOCAB)

    uninterrupted, history = uninterrupted_run(base, data)

    # Interrupted after 5 micro-batches (mid-accumulation, with a neighbour job sharing the steps).
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, [], seed=0)
    trainer.add_job(job)
    trainer.add_job(TrainingJob.create(neighbour(), base, other_data, [], seed=1))
    for _ in range(5):
        trainer.train_step()
    assert job.accumulator.micro_batches == 1 and job.peek() is not None
    assert save_checkpoint(job, tmp_path / "ckpt", "tiny") == tmp_path / "ckpt"
    save_checkpoint(job, tmp_path / "ckpt", "tiny")  # overwriting an existing checkpoint works
    assert has_checkpoint(tmp_path / "ckpt") and not list(tmp_path.glob(".ckpt*"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == FORMAT_2_FILES  # format 2: no pickle
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["format"] == 2
    saved_state = training_state(job)
    for name in list(trainer.jobs):
        trainer.remove_job(name)

    trainer = FusedTrainer(base)
    resumed = TrainingJob.create(spec(), base, data, [], seed=0)
    loaded = load_checkpoint(resumed, tmp_path / "ckpt")
    assert loaded == LoadedCheckpoint(step=2, folder=tmp_path / "ckpt", skipped=[], format=2)
    assert_same_training_state(training_state(resumed), saved_state)
    trainer.add_job(resumed)
    while not resumed.done:
        trainer.train_step()
    assert resumed.step == 8
    assert [r.loss for r in resumed.history] == history
    final = weights(resumed)
    for key, value in uninterrupted.items():   # exactly: see `test_resumed_job_ends_with_the_uninterrupted_adapter`
        assert torch.equal(final[key], value), (key, float((final[key] - value).abs().max()))


def test_a_format_1_checkpoint_resumes_read_with_weights_only(tmp_path, monkeypatch):
    base = from_module(tiny_model("llama", VOCAB), None)
    data = random_examples(0, count=10, vocab=VOCAB)
    uninterrupted, history = uninterrupted_run(base, data)

    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, [], seed=0)
    trainer.add_job(job)
    for _ in range(5):
        trainer.train_step()
    write_format_1(job, tmp_path / "ckpt")
    saved_state = training_state(job)
    trainer.remove_job(job.name)

    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    trainer = FusedTrainer(base)
    resumed = TrainingJob.create(spec(), base, data, [], seed=0)
    loaded = load_checkpoint(resumed, tmp_path / "ckpt")
    assert calls == [True]
    assert loaded == LoadedCheckpoint(step=2, folder=tmp_path / "ckpt", skipped=[], format=1)
    assert_same_training_state(training_state(resumed), saved_state)
    trainer.add_job(resumed)
    while not resumed.done:
        trainer.train_step()
    assert [r.loss for r in resumed.history] == history
    final = weights(resumed)
    for key, value in uninterrupted.items():   # exactly, as from a format-2 checkpoint
        assert torch.equal(final[key], value), (key, float((final[key] - value).abs().max()))
    # the next save writes format 2 over it
    save_checkpoint(resumed, tmp_path / "ckpt", "tiny")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == FORMAT_2_FILES


def test_a_checkpoint_keeps_the_eval_losses_and_reads_older_ones_without_them(tmp_path):
    """The eval losses a stop rule judges come back with the checkpoint (a paused job keeps its history);
    a checkpoint written before they were saved (no "evals" in state.json) loads with none."""
    base = from_module(tiny_model("llama", VOCAB), None)
    data = random_examples(0, count=12, vocab=VOCAB)
    trainer = FusedTrainer(base)
    job = TrainingJob.create(spec(), base, data, data[:4], seed=0)
    trainer.add_job(job)
    while job.step < 4:
        trainer.train_step()
    job.evals = [(2, trainer.evaluate(job)), (4, trainer.evaluate(job))]
    save_checkpoint(job, tmp_path / "ckpt", "tiny")
    trainer.remove_job(job.name)
    resumed = TrainingJob.create(spec(), base, data, data[:4], seed=0)
    load_checkpoint(resumed, tmp_path / "ckpt")
    assert resumed.evals == job.evals and len(resumed.evals) == 2
    state = json.loads((tmp_path / "ckpt/state.json").read_text())
    del state["evals"]
    (tmp_path / "ckpt/state.json").write_text(json.dumps(state))
    remove_adapter(base.model, resumed.name)
    older = TrainingJob.create(spec(), base, data, data[:4], seed=0)
    assert load_checkpoint(older, tmp_path / "ckpt").step == 4 and older.evals == []


def test_an_older_checkpoint_s_step_metrics_read_as_they_were_written():
    """A checkpoint written before the accumulator kept its metrics' weight (their sums were weighted by the
    micro-batches' targets), or one weight for all its metrics, restores the same means; one written now restores
    each metric's weight as saved (a metric one micro-batch lacked: the mean over those that had it)."""
    from actors.checkpoint.state import AccumulatorState
    from actors.engine.step_records import StepAccumulator

    oldest = AccumulatorState(loss_sum=6.0, micro_batches=2, tokens=40, targets=4,
                              metric_sums={"reward": 2.0, "completions/clipped_ratio": 1.0}).restore()
    assert oldest.metrics == {"reward": 0.5, "completions/clipped_ratio": 0.25}
    older = AccumulatorState(loss_sum=6.0, micro_batches=2, tokens=40, targets=3, metric_weight=4.0,
                             metric_sums={"reward": 1.0}).restore()
    assert older.metrics == {"reward": 0.25}
    now = StepAccumulator()
    now.add(0.0, 20, 0, {"reward": 1.0})   # a micro-batch without targets (its completions all masked)
    now.add(2.0, 20, 3, {"reward": 0.0, "rewards/format/mean": 0.5})   # that function scored only here
    saved = AccumulatorState.model_validate(json.loads(json.dumps(dataclasses.asdict(now)))).restore()
    assert saved.metrics == now.metrics == {"reward": 0.25, "rewards/format/mean": 0.5}
    assert saved.loss == now.loss == 2.0
