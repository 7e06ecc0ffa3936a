"""A policy's `compose_step` kept apart from its `decide` (policy_clock.py says why): where one object both decides
and composes steps (`aspen run --in-process`), a step waits for a `decide` that runs at most the policy's time limit
(`policy_timeout_s`); where `decide` still runs after that, or already overran its round (it is left running in its
thread), the step is composed as without a composer (each job's next micro-batch in the order given, while the step
stays within its tokens and memory), said once (the log, the run's `policy_warnings`). A step does not wait for an
overrun call again: a `decide` that never returns would hold every step back by the limit."""

from __future__ import annotations

from collections.abc import Callable

from actors.service.scheduler.policy_clock import PolicyClock
from policies.base import NextBatch, StepComposer


class HeldComposer:
    """`composer.compose_step`, never while `clock` runs the same policy's `decide`; `warn(key, message)`:
    PolicyGuard.warn."""

    def __init__(self, composer: StepComposer, clock: PolicyClock, warn: Callable[[str, str], None]):
        self.composer = composer
        self.clock = clock
        self.warn = warn

    @property
    def composer_name(self) -> str:
        """The policy's class, which StepComposition's messages name."""
        return type(self.composer).__name__

    def compose_step(self, batches: list[NextBatch], cost: Callable[[list[NextBatch]], int], step_tokens: int,
                     fits: Callable[[list[NextBatch]], bool]) -> list[str]:
        overran = self.clock.running is not None and self.clock.running.is_alive()
        if overran or not self.clock.lock.acquire(timeout=self.clock.limit_s):
            name = getattr(self.composer, "name", type(self.composer).__name__)
            self.warn(f"{name} compose_step held", f"policy '{name}': its compose_step was not called while its "
                      f"decide ran past {self.clock.limit_s:g} s (policy_timeout_s; both use the policy's state): "
                      "those steps took each job's next micro-batch in turn, as without a step composer")
            return in_turn(batches, cost, step_tokens, fits)
        try:
            return self.composer.compose_step(batches, cost, step_tokens, fits)
        finally:
            self.clock.lock.release()


def in_turn(batches: list[NextBatch], cost: Callable[[list[NextBatch]], int], step_tokens: int,
            fits: Callable[[list[NextBatch]], bool]) -> list[str]:
    """Each job's next micro-batch in the order given while the step stays within `step_tokens` and `fits`; the
    first always joins (StepComposition's own round-robin, actors/engine/step_composition.py)."""
    chosen: list[NextBatch] = []
    for batch in batches:
        if not chosen or (cost([*chosen, batch]) <= step_tokens and fits([*chosen, batch])):
            chosen.append(batch)
    return [batch.job for batch in chosen]
