"""Predicting a fused step's peak memory from its shape, fitted online to the trainer's measured peaks.

    peak ≈ β0 + β1·T + β2·ΣL² + β3·P + β4·A

T: tokens in the step (padding included), ΣL²: the sum of squared sequence lengths (attention scores
where the kernel materialises them), P: adapter parameters held by the trainer (each with its gradient
and AdamW state), A: the step's analytic bytes that depend on its jobs' LoRA configs and targets rather
than on its size alone (the adapters' own activations, the loss's transient: actors/engine/adapter_activations.py;
0 where not known, its prior coefficient 1). β0 absorbs the frozen base's weights and fixed buffers.

The fit is least squares on the observed steps with non-negative slopes, regularised (slightly) towards
a prior built from the model's shape (so that the first predictions, before there are enough distinct
steps to identify four coefficients, are already sensible), and refitted as steps arrive."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("constant", "tokens", "sum_squared_lengths", "adapter_parameters", "analytic_bytes")


@dataclass(frozen=True)
class StepShape:
    tokens: int
    sum_squared_lengths: int
    adapter_parameters: int
    analytic_bytes: int = 0
    # CPU: what the process's resident set adds beyond the allocator's count (not a feature of the model)
    resident_excess_bytes: int = 0

    @classmethod
    def of(cls, lengths: list[int], adapter_parameters: int, tokens: int | None = None,
           analytic_bytes: int = 0, resident_excess_bytes: int = 0) -> StepShape:
        return cls(tokens if tokens is not None else sum(lengths), sum(n * n for n in lengths), adapter_parameters,
                   analytic_bytes, resident_excess_bytes)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.sum_squared_lengths, self.adapter_parameters, self.analytic_bytes],
                        dtype=np.float64)


class MemoryModel:
    def __init__(self, prior: list[float], *, window: int = 1024, prior_weight: float = 1e-4):
        if len(prior) == len(FEATURES) - 1:   # no analytic part given: it counts as itself
            prior = [*prior, 1.0]
        if len(prior) != len(FEATURES):
            raise ValueError(f"prior needs {len(FEATURES)} coefficients ({', '.join(FEATURES)})")
        self.prior = np.array(prior, dtype=np.float64)
        self.coefficients = self.prior.copy()
        self.rows: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self.prior_weight = prior_weight
        self.errors: deque[float] = deque(maxlen=window)    # relative errors of predictions made before each step

    @classmethod
    def for_model(cls, base_bytes: int, activation_bytes_per_token: float, attention_bytes_per_square: float = 0.0,
                  bytes_per_adapter_parameter: float = 16.0, per_analytic_byte: float = 1.0) -> MemoryModel:
        return cls([float(base_bytes), activation_bytes_per_token, attention_bytes_per_square,
                    bytes_per_adapter_parameter, per_analytic_byte])

    def predict(self, shape: StepShape) -> int:
        return int(round(float(shape.features() @ self.coefficients)))

    def observe(self, shape: StepShape, peak_bytes: int, predicted: int | None = None) -> None:
        if predicted is not None and peak_bytes > 0:
            self.errors.append(abs(predicted - peak_bytes) / peak_bytes)
        self.rows.append((shape.features(), float(peak_bytes)))
        self.refit()

    def refit(self) -> None:
        """Ridge regression towards the prior, on features scaled to comparable magnitudes."""
        if not self.rows:
            return
        x = np.stack([row for row, _ in self.rows])
        y = np.array([peak for _, peak in self.rows])
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)
        y_scale = max(float(np.abs(y).max()), 1.0)
        xs, ys = x / scale, y / y_scale
        prior_scaled = self.prior * scale / y_scale
        weight = self.prior_weight   # tiny: it only decides directions the data leaves open
        # Memory grows with tokens, squared lengths and adapter parameters: those coefficients are kept
        # >= 0 (a feature whose fit goes negative is dropped and the rest refitted), so that the model
        # extrapolates sensibly to steps larger than those seen so far.
        free = list(range(len(FEATURES)))
        solution = np.zeros(len(FEATURES))
        for _ in range(len(FEATURES)):
            sub = np.ix_(free, free)
            lhs = (xs.T @ xs + weight * np.eye(len(FEATURES)))[sub]
            rhs = (xs.T @ ys + weight * prior_scaled)[free]
            solution = np.zeros(len(FEATURES))
            solution[free] = np.linalg.solve(lhs, rhs)
            negative = [i for i in free if i > 0 and solution[i] < 0]
            if not negative:
                break
            free = [i for i in free if i not in negative]
        self.coefficients = solution * y_scale / scale

    @property
    def mean_error(self) -> float | None:
        return float(np.mean(self.errors)) if self.errors else None

    def state(self) -> dict:
        return {"coefficients": dict(zip(FEATURES, self.coefficients.tolist(), strict=True)),
                "observations": len(self.rows),
                "mean_relative_error": self.mean_error}
