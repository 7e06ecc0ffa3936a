"""Each replay of a `compile: graphs` step checked against the same step run eagerly from the same state.

`CheckedGraphs` is `StepGraphs` (actors/engine/step_graphs.py) whose replays are followed by the step of the same
inputs run eagerly, from the gradients the replay started from: the two steps' per-job losses and per-job gradient
sums are recorded (`checks`) and the replay's gradients kept. The eager step comes second, so that what it
refreshes (the jobs' compute-dtype copies, the layers' kept stacks) cannot hide a refresh the graph lacks. On the
CPU stand-in (tests/helpers/graph_replay.py) the two are equal bit for bit; on a GPU they differ by the order of
the device's atomic additions. Both runs start from the same weights at every step, so the check holds at a real
learning rate, where a replay that read last step's weights would differ by a step's update.

Use: `monkeypatch.setattr(actors.engine.graphed_steps, "StepGraphs", CheckedGraphs)` before making the trainer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.step_graphs import StepGraphs


@dataclass
class ReplayCheck:
    """One replay against its eager step: per job, the losses and the gradients each added (float32, on the host)."""

    losses: tuple[torch.Tensor, torch.Tensor]
    gradients: list[tuple[torch.Tensor, torch.Tensor]]

    def largest_loss_difference(self) -> float:
        """The largest |replay - eager| over the jobs' losses, relative to the eager loss."""
        replay, eager = self.losses
        return float(((replay - eager).abs() / eager.abs().clamp_min(1e-30)).max())

    def largest_gradient_difference(self) -> float:
        """The largest |replay - eager| over a job's gradients, relative to that job's largest eager gradient."""
        return max(float((replay - eager).abs().max()) / max(float(eager.abs().max()), 1e-30)
                   for replay, eager in self.gradients)


class CheckedGraphs(StepGraphs):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks: list[ReplayCheck] = []

    def _replay(self, entry, pools):
        if getattr(entry.graph, "fresh", False):   # the CPU stand-in's capture computed this step already
            return super()._replay(entry, pools)
        start = [pool.grads.values.clone() for pool in pools]
        objective = super()._replay(entry, pools)
        replayed = [pool.grads.values - before for pool, before in zip(pools, start, strict=True)]
        replay_losses = objective.job_losses.detach().clone()
        for pool, before in zip(pools, start, strict=True):
            pool.grads.values.copy_(before)
        eager = self.eager_step(entry)
        added = [pool.grads.values - before for pool, before in zip(pools, start, strict=True)]
        self.checks.append(ReplayCheck(
            (replay_losses.float().cpu(), eager.job_losses.detach().float().cpu()),
            [(got.cpu(), expected.cpu()) for got, expected in zip(replayed, added, strict=True)]))
        for pool, before, got in zip(pools, start, replayed, strict=True):   # the replay's gradients are the step's
            pool.grads.values.copy_(before + got)
        return objective
