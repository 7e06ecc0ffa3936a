"""A pipeline trainer's memory admission (actors/service/pipeline/pipeline_admission.py) against the allocator's own
count of each stage's peak over each loop step (torch.profiler's memory records on CPU): every stage's
prediction, refitted online, stays within one in-flight micro-batch of the measured peak (what the model
cannot know before the head composes: which of the step's micro-batches are in flight together at a stage);
the budget is per stage, the status reports the critical stage (its share of the weights, not the whole
base's); a budget that fits one job's step but not two's runs the jobs one per step; a budget below a stage's
weights is refused, naming the stage and the numbers."""

from __future__ import annotations

import functools

import pytest
import torch

from actors.data import DataCursor
from actors.engine.packing import JobMicroBatch
from actors.service.pipeline.pipeline_admission import PipelineAdmission
from actors.service.pipeline.pipeline_engine import start_pipeline
from actors.service.scheduler.config import TrainerConfig
from tests.helpers.grpo_jobs import PROMPTS
from tests.helpers.pipeline import one_thread_per_process, tiny_base

STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from one_thread_per_process()


def jobs_on(engine, count: int):
    from tests.helpers.pipeline import sft
    jobs = []
    for index in range(count):
        spec, examples, seed = sft(f"mem-{index}", index, steps=STEPS, batch_size=4,
                                   lora={"dropout": 0.1 if index % 2 else 0.0, "r": 8})
        job = engine.attach(spec, DataCursor(examples, spec.batch_size, seed=seed, epochs=None), [], STEPS, seed=seed)
        engine.add_job(job)
        jobs.append(job)
    return jobs


def test_each_stages_peak_is_predicted_within_one_micro_batch_and_a_tight_budget_runs_one_job_a_step():
    config = TrainerConfig(stages=2, stage_split="even", step_tokens=2048)
    engine = start_pipeline(config, functools.partial(tiny_base, layers=6), threads=1)
    try:
        with pytest.raises(MemoryError, match=r"pipeline stage 0: its weights take \d+ MiB, the memory budget per "
                                              r"stage is 0 MiB; raise memory_budget_bytes"):
            PipelineAdmission(engine, budget_bytes=1 << 10)
        admission = PipelineAdmission(engine)
        whole = sum(p.numel() * p.element_size() for p in tiny_base(layers=6).model.parameters())
        assert admission.base_bytes < 0.8 * whole   # the critical stage's share of the weights
        jobs = jobs_on(engine, 4)
        misses = []
        for _ in range(STEPS - 1):
            chosen = engine.compose(jobs, admission.fits)
            shape = admission.shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
            predicted = [model.predict(s) for model, s in zip(admission.models, admission.shapes, strict=True)]
            plan = admission.largest_plan([JobMicroBatch(job.name, batch) for job, batch in chosen])
            report = engine.run_step(chosen, measure=True)
            assert report.memory_measured and len(engine.last_peaks) == 2
            for memory, guess, peak in zip(admission.stages, predicted, engine.last_peaks, strict=True):
                a = memory.activation
                tokens = sum(count for _, count in plan)
                one_micro_batch = a.saved_constant + a.saved_per_token * tokens + memory.adapters(plan)
                misses.append((abs(guess - peak), one_micro_batch, guess, peak))
            admission.observe(shape, report, max(predicted))
        late = misses[4:]   # after the first measured steps refitted the models
        assert all(miss <= bound for miss, bound, _, _ in late), late
        assert admission.memory_model.mean_error is not None

        # a budget the step of one job fits and the step of all four does not: one job a step
        one = [JobMicroBatch(jobs[0].name, jobs[0].peek())]
        every = [JobMicroBatch(job.name, job.peek()) for job in jobs]
        admission.under_predictions.clear()
        low, high = max(admission.predictions(one)), max(admission.predictions(every))
        assert low < high
        admission.budget = int((low + high) / 2 * (1 + admission.margin))
        assert admission.fits(one) and not admission.fits(every)
        chosen = engine.compose(jobs, admission.fits)
        assert 1 <= len(chosen) < 4
    finally:
        engine.close()


@pytest.mark.parametrize(("rows", "prompt", "new"), [(4, 6, 3), (24, 40, 8), (12, 90, 30)])
def test_each_stages_sampling_is_bounded_by_its_estimate_and_a_budget_below_it_refuses_a_grpo_job(rows, prompt, new):
    """Decoding over uneven stages (a GRPO job's sampling: 2 and 4 layers) against each stage's allocator count of
    it: never above the stage's estimate (its own layers' KV cache, one layer's prompt pass, the logits at the
    first and last stage), nor so far below that it would refuse what fits (3x, as on one device). A budget per
    stage that leaves less than a stage's estimate beside its weights refuses a grpo job of that size, naming
    the stage and what to lower; a budget that leaves room admits it."""
    from actors.engine.generate import Sampling, greedy_generate_many
    from tests.helpers.fused import job_spec
    from tests.helpers.pipeline import VOCAB

    config = TrainerConfig(stages=2, stage_split=[2, 4], step_tokens=2048)
    engine = start_pipeline(config, functools.partial(tiny_base, layers=6), threads=1)
    try:
        prompts = [[(7 * i + j) % (VOCAB - 10) + 5 for j in range(prompt - i % 3)] for i in range(rows)]
        held = [memory.held for memory in engine.memory()]
        engine.pipeline.measure(True)
        greedy_generate_many(engine.base, [(None, p) for p in prompts], new, set(),
                             Sampling(1.0, 0, torch.Generator().manual_seed(0)), decoder=engine.decode)
        measured = [peak - live for peak, live in zip(engine.pipeline.measure(False), held, strict=True)]
        estimates = [engine.sampling_bytes(stage, rows, prompt + new) for stage in range(2)]
        for stage, (used, estimate) in enumerate(zip(measured, estimates, strict=True)):
            assert 0 < used <= estimate <= 3 * used, (stage, used, estimate)

        width = max(prompt, 8) + new   # a job's largest rollout: rows sequences of max_seq_len + max_new_tokens
        spec = job_spec("rl", method="grpo", batch_size=rows // 2, max_seq_len=max(prompt, 8), format=PROMPTS,
                        grpo={"reward": "contains", "num_generations": 2, "max_new_tokens": new})
        admission = PipelineAdmission(engine)
        needs = [engine.sampling_bytes(stage, rows, width) for stage in range(2)]
        tight = max(w + e for w, e in zip(admission.weights, needs, strict=True)) - 1
        admission.budget = tight
        refusal = admission.sampling_refusal(spec)
        assert refusal is not None and f"({rows} sequences of up to {width} tokens)" in refusal, refusal
        assert "at pipeline stage" in refusal and "lower batch_size, grpo.num_generations" in refusal, refusal
        admission.budget = int(2 * tight)
        assert admission.sampling_refusal(spec) is None
    finally:
        engine.close()
