"""What one policy's simulated run gives (turnaround, waiting, makespan, throughput, early stops, moves,
OOMs), and the table that compares the policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(kw_only=True)
class Result:
    policy: str
    turnaround: list[float]
    waiting: list[float]
    makespan: float
    tokens: int
    steps: int
    ooms: int
    stopped_early: int
    fused_steps: int
    priorities: list[int] = field(default_factory=list)
    moves: int = 0
    trained: list[tuple[float, str | None, int]] = field(default_factory=list)   # (time, user, tokens)

    def by_priority(self) -> dict[int, float]:
        """Mean turnaround of each priority level."""
        levels = sorted(set(self.priorities), reverse=True)
        return {level: float(np.mean([t for t, p in zip(self.turnaround, self.priorities, strict=True) if p == level]))
                for level in levels}

    def row(self) -> dict[str, Any]:
        turnaround = np.array(self.turnaround)
        return {"turnaround_by_priority_s": self.by_priority(), "policy": self.policy,
                "mean_turnaround_s": float(turnaround.mean()),
                "p95_turnaround_s": float(np.quantile(turnaround, 0.95)), "mean_wait_s": float(np.mean(self.waiting)),
                "makespan_s": self.makespan, "throughput_tokens_per_s": self.tokens / max(self.makespan, 1e-9),
                "jobs_per_hour": 3600 * len(self.turnaround) / max(self.makespan, 1e-9), "oom": self.ooms,
                "stopped_early": self.stopped_early, "optimizer_steps": self.steps, "fused_steps": self.fused_steps,
                "moves": self.moves}


def table(results: list[Result], reference: str = "fifo") -> str:
    rows = [r.row() for r in results]
    base = next((r for r in rows if r["policy"] == reference), None)
    header = (f"{'policy':<17} {'turnaround':>11} {'vs ' + reference:>8} {'p95':>9} {'wait':>9} {'makespan':>9} "
              f"{'tokens/s':>9} {'jobs/h':>7} {'early':>5} {'moves':>5} {'OOM':>4}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = f"{row['mean_turnaround_s'] / base['mean_turnaround_s']:.2f}x" if base else "-"
        lines.append(f"{row['policy']:<17} {row['mean_turnaround_s']:>10.1f}s {ratio:>8} "
                     f"{row['p95_turnaround_s']:>8.1f}s "
                     f"{row['mean_wait_s']:>8.1f}s {row['makespan_s']:>8.1f}s {row['throughput_tokens_per_s']:>9.0f} "
                     f"{row['jobs_per_hour']:>7.1f} {row['stopped_early']:>5} {row['moves']:>5} {row['oom']:>4}")
    if any(len(r.by_priority()) > 1 for r in results):
        lines.append("mean turnaround by priority (highest first):")
        for result in results:
            lines.append(f"  {result.policy:<10} " + "  ".join(f"priority {level}: {value:.1f}s"
                                                          for level, value in result.by_priority().items()))
    return "\n".join(lines)
