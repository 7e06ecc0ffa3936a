"""The step-memory model: it recovers known coefficients from synthetic data, and, as the trainer loop's
step admission uses it (its prior probed on the model, fitted online to the measured peaks), it predicts a
real trainer's next steps within 3% of the allocator's count."""

from __future__ import annotations

import random

import numpy as np

from actors.engine.job import TrainingJob
from actors.engine.models import from_module
from actors.engine.packing import JobMicroBatch
from actors.engine.spec import JobSpec
from actors.engine.trainer import FusedTrainer
from actors.service.step_admission import StepAdmission
from policies.memory_model import MemoryModel, StepShape
from tests.helpers.models import random_examples, tiny_model


def test_recovers_known_coefficients_from_synthetic_steps():
    truth = np.array([5.0e8, 2.0e4, 8.0, 16.0, 1.0])   # no analytic bytes here: that coefficient keeps its prior
    rng = random.Random(0)
    model = MemoryModel([1.0e8, 1.0e4, 0.0, 10.0])          # a poor prior
    for _ in range(300):
        lengths = [rng.randint(16, 512) for _ in range(rng.randint(1, 24))]
        shape = StepShape.of(lengths, rng.randint(100_000, 5_000_000))
        model.observe(shape, int(shape.features() @ truth * (1 + rng.gauss(0, 1e-5))))
    relative = np.abs(model.coefficients - truth) / truth
    assert relative.max() < 0.02, (model.coefficients, relative)
    shape = StepShape.of([300, 200, 100], 2_000_000)
    assert abs(model.predict(shape) - shape.features() @ truth) / (shape.features() @ truth) < 1e-3


def test_predicts_a_real_trainers_steps_within_three_percent(tiny_model_dirs, smol_tokenizer):
    base = from_module(tiny_model("llama"), smol_tokenizer)
    trainer = FusedTrainer(base, step_tokens=1024)
    admission = StepAdmission(trainer)   # the trainer loop's: its prior from probe steps on this model
    rng = random.Random(1)
    errors = []
    for step in range(40):
        if step % 8 == 0:   # jobs arrive over time with different adapter sizes and data
            index = len(trainer.jobs)
            spec = JobSpec(name=f"j{index}", data="unused.jsonl", format={"type": "text"}, max_steps=1000,
                           batch_size=rng.randint(2, 6), lora={"r": 4 * (index + 1), "target_modules": "all-linear"})
            examples = random_examples(index, 64, min_len=8, max_len=rng.choice([40, 120, 200]))
            trainer.add_job(TrainingJob.create(spec, base, examples, [], seed=index))
        chosen = trainer.compose()
        shape = admission.shape([JobMicroBatch(job.name, batch) for job, batch in chosen])
        predicted = admission.predict(shape)
        report = trainer.run_step(chosen, measure=True)   # the allocator's count, not the engine's arithmetic
        assert report.memory_measured
        if step >= 24:
            errors.append(abs(predicted - report.peak_memory_bytes) / report.peak_memory_bytes)
        admission.observe(shape, report, predicted)
    assert admission.measured_steps == 40
    assert float(np.mean(errors)) <= 0.03, errors
    assert max(errors) <= 0.06, errors
