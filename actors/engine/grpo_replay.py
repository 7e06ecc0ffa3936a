"""A GRPO job's generations trained on more than once: TRL's `num_iterations` (mu). The completions sampled for
one optimizer step's micro-batches (the generation) are trained on for `num_iterations` optimizer steps: the first
samples them, the others replay them, each later step's loss taking its ratio against the log-probabilities the
completions had when they were sampled (the first step's, before its update: `old_logps`).

`GrpoReplay` is what a `TrainingJob` holds of it: the generation's micro-batches (each its rollouts and their
completion tokens' old log-probabilities, in the order of the micro-batch's targets), which iteration the job is in
(0: generating) and the next micro-batch to replay. It is part of the job's checkpoint (`state` / `from_state`): a
job resumed mid-replay trains on the same completions against the same old log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from actors.data import Example
from actors.engine.grpo import Rollout


@dataclass
class ReplayedBatch:
    """One micro-batch of the generation: its rollouts (the very list the step trained on) and the log-probabilities
    of their completion tokens at their generation step (float32, on the trainer's device until saved)."""

    rollouts: list[Rollout]
    old_logps: torch.Tensor | None   # None until known (a pipeline's head composes before the last stage computes)


@dataclass
class GrpoReplay:
    iterations: int
    batches: list[ReplayedBatch] = field(default_factory=list)
    iteration: int = 0   # 0: the generation's micro-batches are sampled; 1..iterations-1: they are replayed
    position: int = 0    # the next micro-batch to replay

    @property
    def replaying(self) -> bool:
        return self.iteration > 0

    def next_batch(self) -> list[Rollout] | None:
        """The micro-batch to replay next (None past the generation's last: the optimizer step is due)."""
        return self.batches[self.position].rollouts if self.position < len(self.batches) else None

    def taken(self) -> None:
        self.position += 1

    @property
    def iteration_done(self) -> bool:
        """Whether this replay's micro-batches have all been taken (its optimizer step is due)."""
        return self.replaying and self.position >= len(self.batches)

    def record(self, rollouts: list[Rollout], logps: torch.Tensor | None) -> ReplayedBatch:
        """A generation micro-batch the step just trained on, with its completion tokens' log-probabilities (None:
        filled in when known, `ReplayedBatch.old_logps`)."""
        batch = ReplayedBatch(rollouts, None if logps is None else logps.detach().to(torch.float32))
        self.batches.append(batch)
        return batch

    def old_logps(self, rollouts: list) -> torch.Tensor:
        """The old log-probabilities of a replayed micro-batch (the very list `next_batch` gave); LookupError for
        another list (its ratios would silently be 1)."""
        found = next((batch for batch in self.batches if batch.rollouts is rollouts), None)
        if found is None or not self.replaying:
            raise LookupError("a replayed GRPO micro-batch is not one of its generation's (the step must get the very "
                              "list the job's peek gave)")
        if found.old_logps is None:
            raise LookupError("a replayed GRPO micro-batch's log-probabilities at its generation are not known yet "
                              "(its generation step was not booked)")
        return found.old_logps

    def stepped(self) -> None:
        """An optimizer step was taken: the next iteration replays the generation, or (after the last) the next
        generation is sampled."""
        if not self.batches:
            return
        self.iteration += 1
        self.position = 0
        if self.iteration >= self.iterations:
            self.iteration, self.batches = 0, []

    # -- in a checkpoint (actors/checkpoint/state.py: ReplayState) ----------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """JSON-ready; None when nothing is held (between generations)."""
        if not self.batches:
            return None
        return {"iteration": self.iteration, "position": self.position,
                "batches": [{"rollouts": [_rollout_state(r) for r in batch.rollouts],
                             "old_logps": _known(batch).cpu().tolist()} for batch in self.batches]}

    @classmethod
    def from_state(cls, iterations: int, state: Any | None, device: torch.device) -> GrpoReplay:
        """From a checkpoint's `replay` (a `ReplayState`, or None)."""
        if state is None:
            return cls(iterations)
        batches = [ReplayedBatch([_rollout(r) for r in batch.rollouts],
                                 torch.tensor(batch.old_logps, dtype=torch.float32, device=device))
                   for batch in state.batches]
        return cls(iterations, batches, state.iteration, state.position)


def _known(batch: ReplayedBatch) -> torch.Tensor:
    if batch.old_logps is None:
        raise RuntimeError("a GRPO generation is saved before its log-probabilities were known: save a job between "
                           "its steps")
    return batch.old_logps


def _rollout_state(rollout: Rollout) -> dict[str, Any]:
    return {"input_ids": [list(c.input_ids) for c in rollout.completions],
            "labels": [list(c.labels) for c in rollout.completions], "prompt_length": rollout.prompt_length,
            "rewards": list(rollout.rewards), "scores": [list(s) for s in rollout.scores],
            "advantages": list(rollout.advantages), "truncated": list(rollout.truncated)}


def _rollout(state: Any) -> Rollout:
    completions = tuple(Example(tuple(ids), tuple(labels)) for ids, labels in zip(state.input_ids, state.labels,
                                                                                   strict=True))
    return Rollout(completions, state.prompt_length, tuple(state.rewards), tuple(tuple(s) for s in state.scores),
                   tuple(state.advantages), tuple(state.truncated))
