"""The fused step's host path (issue: a GPU step that never waits for the host): the batch crosses to the device
in one copy with the layout's sequence bounds, the optimizers' norms and clipping can stay on the device, the
losses and norms are read back once, and the next step's batch is packed while a step runs. Checked on the CPU
against the way each replaces (the batch's own tensors, the host-side norm and clip, the step without packing
ahead); and a step of many jobs composed in time linear in its jobs (its token count kept as they join)."""

from __future__ import annotations

import math

import pytest
import torch

from actors.engine import flat_adamw, step_batches
from actors.engine import trainer as trainer_module
from actors.engine.job import TrainingJob
from actors.engine.joint_steps import step_jobs
from actors.engine.models import from_module
from actors.engine.optim import JobOptimizer
from actors.engine.packing import JobMicroBatch, pack
from actors.engine.step_composition import StepTokens
from tests.helpers.cuda_path_runs import on_the_cuda_path, one_rank_jobs, run_planned
from tests.helpers.fused import VOCAB, job_spec
from tests.helpers.isolation import base_for
from tests.helpers.models import random_examples, tiny_model
from tests.helpers.tolerances import unit_roundoff


def test_the_batch_crosses_in_one_copy_with_its_sequence_bounds():
    examples = random_examples(0, count=5, vocab=VOCAB, min_len=3, max_len=9)
    batch = pack([JobMicroBatch("a", examples[:2]), JobMicroBatch("b", examples[2:])])
    moved = batch.to(torch.device("cpu"))
    for name in ("input_ids", "position_ids", "target_index", "target_ids", "target_job"):
        assert torch.equal(getattr(moved, name), getattr(batch, name)), name
    buffers = {getattr(moved, name).untyped_storage().data_ptr()
               for name in ("input_ids", "position_ids", "target_index", "target_ids", "target_job")}
    assert len(buffers) == 1, "the batch's tensors are views of one buffer: one copy"
    assert moved.job_target_counts.tolist() == batch.job_targets
    bounds = [0] + [end for _, end in batch.layout.sequences]
    assert batch.layout.cu_seqlens(torch.device("cpu")).tolist() == bounds
    assert batch.layout.cu_seqlens(torch.device("cpu")).dtype == torch.int32


def _optimizers(seed: int, jobs: int = 3, clip: float | None = 1.0) -> list[JobOptimizer]:
    generator = torch.Generator().manual_seed(seed)
    optimizers = []
    for index in range(jobs):
        parameters = [torch.nn.Parameter(torch.randn(4, 6, generator=generator)) for _ in range(3)]
        spec = job_spec(f"j{index}", max_grad_norm=clip if index != 1 else None, lr=1e-2, weight_decay=0.01)
        optimizers.append(JobOptimizer(spec, parameters, total_steps=10))
    return optimizers


def _two_steps(optimizers: list[JobOptimizer], on_device: bool) -> list[list[tuple[float, float]]]:
    """Two optimizer steps on gradients of growing scale (job i's x10^i, then x3): AdamW's second update
    depends on the first gradient's size relative to the second's, so clipping shows in the weights."""
    generator = torch.Generator().manual_seed(1)
    results = []
    for scale in (1.0, 3.0):
        for index, optimizer in enumerate(optimizers):
            for parameter in optimizer.parameters:
                parameter.grad = torch.randn(parameter.shape, generator=generator) * (10.0 ** index) * scale
        results.append([(lr, float(norm)) for lr, norm in step_jobs(optimizers, [5, 7, 11], on_device=on_device)])
    return results


def test_norms_and_clipping_on_the_device_equal_the_host_ones_to_rounding():
    """The on-device way sums each job's squared norms in float64 in the device's order (the host way in
    `chained_sum`'s): the norms agree to float64 rounding, the clip factors (float32) to float32 rounding, so
    the weights after two AdamW steps agree within a few float32 roundings of the steps (the gradients are far
    from 0, where AdamW would magnify a difference: tests/helpers/tolerances.py)."""
    host, device = _optimizers(0), _optimizers(0)
    host_results, device_results = _two_steps(host, False), _two_steps(device, True)
    for step_h, step_d in zip(host_results, device_results, strict=True):
        for (lr_h, norm_h), (lr_d, norm_d) in zip(step_h, step_d, strict=True):
            assert lr_h == lr_d and math.isclose(norm_d, norm_h, rel_tol=1e-12)
    u = unit_roundoff()
    for a, b in zip(host, device, strict=True):
        assert a.step_count == b.step_count == 2
        for p, q in zip(a.parameters, b.parameters, strict=True):
            assert p.grad is None and q.grad is None
            assert float((p - q).abs().max()) <= 32 * u * (float(p.abs().max()) + a.spec.lr), a.spec.name
    unclipped = _optimizers(0, clip=None)
    _two_steps(unclipped, True)
    assert not torch.allclose(unclipped[2].parameters[0], device[2].parameters[0], rtol=0, atol=1e-5), \
        "clipping made no difference: the test does not see it"


def test_the_losses_and_norms_are_read_back_once():
    losses = torch.tensor([1.5, 2.25], dtype=torch.float32)
    reads = []
    original = torch.Tensor.tolist

    def counting(self):
        reads.append(self.shape)
        return original(self)

    torch.Tensor.tolist = counting
    try:
        values, norms = trainer_module._read_back(losses, [torch.tensor(3.0, dtype=torch.float64), 0.0,
                                                           torch.tensor(0.5, dtype=torch.float64)])
    finally:
        torch.Tensor.tolist = original
    assert values == [1.5, 2.25] and norms == [3.0, 0.0, 0.5]
    assert len(reads) == 1


def _train(prepack: bool, monkeypatch) -> tuple[list, dict, int, int, int]:
    """Three jobs of 4, 5 and 6 steps; (losses, weights, steps, batches packed, steps that found theirs packed)."""
    packs, hits = [], []
    original_pack = step_batches.pack
    monkeypatch.setattr(step_batches, "pack", lambda *args: packs.append(1) or original_pack(*args))
    original_for_step = step_batches.StepBatches.for_step

    def watching(self, micro_batches):
        key = tuple((mb.job, id(mb.examples)) for mb in micro_batches)
        hits.append(self.prepacked is not None and self.prepacked[0] == key)
        return original_for_step(self, micro_batches)

    monkeypatch.setattr(step_batches.StepBatches, "for_step", watching)
    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = trainer_module.FusedTrainer(base, step_tokens=100_000)
    trainer.batches.ahead = prepack
    jobs = [TrainingJob.create(job_spec(f"job-{index}", max_steps=4 + index), base,
                               random_examples(index, vocab=VOCAB), [], seed=index) for index in range(3)]
    for job in jobs:
        trainer.add_job(job)
    losses = []
    while (report := trainer.train_step()) is not None:
        losses.append([(r.job, r.loss) for r in report.results])
    weights = {job.name: {k: v.detach().clone() for k, v in job.adapter.named_parameters()} for job in jobs}
    monkeypatch.undo()
    return losses, weights, len(losses), len(packs), sum(hits)


def test_packing_the_next_step_ahead_changes_nothing_and_is_used(monkeypatch):
    plain_losses, plain_weights, steps, plain_packs, plain_hits = _train(False, monkeypatch)
    ahead_losses, ahead_weights, ahead_steps, ahead_packs, ahead_hits = _train(True, monkeypatch)
    assert steps == ahead_steps == 6
    assert plain_packs == steps and plain_hits == 0
    assert ahead_losses == plain_losses
    for name, weights in plain_weights.items():
        for key, value in weights.items():
            assert torch.equal(ahead_weights[name][key], value), (name, key)
    # every step after the first found its batch packed during the step before (the jobs that ended are
    # known to have ended before the next step is guessed), and nothing was packed twice
    assert ahead_hits == steps - 1 and ahead_packs == steps


def test_a_step_composed_otherwise_packs_its_own(monkeypatch):
    """A guess that does not come true (here: a job removed between steps) is dropped, not used."""
    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = trainer_module.FusedTrainer(base, step_tokens=100_000)
    trainer.batches.ahead = True
    jobs = [TrainingJob.create(job_spec(f"job-{index}", max_steps=3), base, random_examples(index, vocab=VOCAB),
                               [], seed=index) for index in range(2)]
    for job in jobs:
        trainer.add_job(job)
    first = trainer.train_step()
    assert trainer.batches.prepacked is not None and len(trainer.batches.prepacked[0]) == 2
    trainer.remove_job("job-0")
    second = trainer.train_step()
    assert [r.job for r in second.results] == ["job-1"] and second.tokens < first.tokens
    solo_base = from_module(tiny_model("llama", VOCAB), None)
    solo = trainer_module.FusedTrainer(solo_base, step_tokens=100_000)
    alone = TrainingJob.create(job_spec("job-1", max_steps=3), solo_base, random_examples(1, vocab=VOCAB), [], seed=1)
    solo.add_job(alone)
    solo.train_step()
    assert solo.train_step().results[0].loss == second.results[0].loss


@pytest.mark.parametrize("layout", ["packed", "padded", "padded_fused"])
@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "compiled"])
def test_a_step_s_running_token_count_is_the_full_count(layout, bucketed):
    """`StepTokens` keeps a step's cost as micro-batches join: with each next one it is `step_cost` of them all,
    counted afresh (rows of different lengths, micro-batches of different sizes, padding and the compiled bucket)."""
    trainer = trainer_module.FusedTrainer(from_module(tiny_model("llama", VOCAB), None), layout=layout)
    trainer.composition.bucketed = bucketed   # step_cost's bucket (a compiled trainer's)
    tokens = StepTokens(layout, bucketed=bucketed)
    joined: list[JobMicroBatch] = []
    for index in range(12):
        micro_batch = JobMicroBatch(f"job-{index}", random_examples(index, count=1 + index % 4, vocab=VOCAB,
                                                                    min_len=2 + index, max_len=9 + 5 * index))
        assert tokens.cost_with(micro_batch) == trainer.step_cost([*joined, micro_batch]), index
        tokens.add(micro_batch)
        joined.append(micro_batch)


def test_many_jobs_are_composed_within_the_budget_as_a_full_count_chooses(monkeypatch):
    """32 jobs round-robin under a budget that takes some and skips others (a long micro-batch that does not fit
    is skipped, a shorter one after it still joins; a `fits` that refuses one job): the jobs chosen are those that
    counting each trial step afresh chooses, and `step_cost` is not called (a step is composed in linear time)."""
    base = from_module(tiny_model("llama", VOCAB), None)
    trainer = trainer_module.FusedTrainer(base, step_tokens=400)
    jobs = [TrainingJob.create(job_spec(f"job-{index}", batch_size=1 + index % 3), base,
                               random_examples(index, vocab=VOCAB, min_len=4, max_len=60), [], seed=index)
            for index in range(32)]
    for job in jobs:
        trainer.add_job(job)

    def fits(micro_batches):
        return all(mb.job != "job-7" for mb in micro_batches)

    expected = []   # the reference: each candidate's trial step counted whole
    for job in jobs:
        trial = [JobMicroBatch(j.name, j.peek()) for j in expected] + [JobMicroBatch(job.name, job.peek())]
        if not expected or (trainer.step_cost(trial) <= 400 and fits(trial)):
            expected.append(job)
    assert 1 < len(expected) < 31 and jobs[7] not in expected
    over_budget = [job for job in jobs[:jobs.index(expected[-1])] if job not in expected and job is not jobs[7]]
    assert over_budget, "no job was skipped for the budget before a later one joined: the case is not tested"
    full_counts = []
    monkeypatch.setattr(trainer.composition, "step_cost", lambda micro_batches: full_counts.append(1))
    chosen = trainer.compose(fits=fits)
    assert [job.name for job, _ in chosen] == [job.name for job in expected]
    assert not full_counts


def test_the_read_back_waits_for_the_norms_not_the_updates(monkeypatch):
    """On the CUDA path (here on a CPU) a step's one read-back comes after its norms and before its AdamW updates
    are launched, so that on a GPU it waits for the backward, not the optimizers; the updates still run within the
    step, every due job's once (what they compute: tests/unit/engine/test_flat_adamw.py, and the CUDA path's runs
    against the float32 path and PEFT: tests/unit/engine/test_cuda_path_engine.py)."""
    calls = on_the_cuda_path(monkeypatch, "grouped_mm")
    order: list[str] = []
    read_back = trainer_module._read_back
    monkeypatch.setattr(trainer_module, "_read_back", lambda *args: order.append("read") or read_back(*args))
    update = flat_adamw.FlatAdamW.update   # on_the_cuda_path's counting one
    monkeypatch.setattr(flat_adamw.FlatAdamW, "update",
                        lambda self, *args: order.append("update") or update(self, *args))
    steps = []
    _, _, count = run_planned(base_for("bfloat16"), one_rank_jobs(),
                                   between_steps=lambda trainer, jobs: steps.append(list(order)) or order.clear())
    assert count >= 3 and calls.flat_updates > 0
    for seen in steps:
        assert seen[0] == "read" and seen.count("read") == 1 and set(seen[1:]) <= {"update"}, seen
    assert sum(seen.count("update") for seen in steps) == calls.flat_updates
