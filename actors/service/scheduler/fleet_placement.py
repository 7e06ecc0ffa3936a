"""The trainer fleet's placement bookkeeping (Ray-free): why Ray cannot place each trainer now, and what the service
says of the trainers that do not run.

Split out of `trainer_fleet.py`: when each trainer's actor was asked for, why Ray cannot place it now (looked at once
it waited PLACEMENT_WAIT_S unstarted, then every `cluster_poll_s`: placement_waits.py), whether the service's wait for
its trainers may end, why the queued jobs of a base wait, and why none runs.

A `nodes: each` kind that no live node can hold has no trainer at all (none is started: cluster_plan.py). Where the
service runs none, its jobs' reason and its description's `trainers_error` said so; where other kinds run, the
jobs of that kind's base said "no trainer holds base model ..., start a trainer for it" (the policy's reason, of a
kind that is configured) and nothing said why it has none. Now `unplanned` says it (`trainers_error`, which
`aspen serve` prints) and `waits_by_base` gives its base's jobs that reason."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from actors.service.scheduler.cluster_plan import NodeInfo
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.placement_waits import (
    PLACEMENT_WAIT_S,
    Autoscaling,
    PlacementWait,
    look_at_placement,
    none_planned,
)

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """A trainer's actor as Ray places it: when it was asked for, why Ray cannot place it now (None: placed, or
    not known not to be), when that was last looked at."""

    launched_at: float = 0.0
    unplaced: PlacementWait | None = None
    seen_at: float = 0.0

    def launched(self, now: float) -> None:
        self.launched_at, self.unplaced, self.seen_at = now, None, 0.0

    def look(self, trainer_id: str, config: TrainerConfig, nodes: list[NodeInfo],
             autoscaling: Callable[[dict[str, float]], Autoscaling], poll_s: float, now: float) -> str | None:
        """Whether any live node could hold the unstarted trainer, looked at once it waited PLACEMENT_WAIT_S, then
        every `poll_s` (each look asks the autoscaler again where no node holds it: an unanswered ask is asked
        again); why it never can be placed (it fails), else None."""
        if now - self.launched_at < PLACEMENT_WAIT_S or now - self.seen_at < poll_s:
            return None
        self.seen_at = now
        wait = look_at_placement(config, nodes, autoscaling)
        if wait is not None and wait != self.unplaced:
            log.warning("scheduler: trainer %s %s", trainer_id, wait.reason)
        self.unplaced = wait
        if wait is not None and wait.final:
            self.unplaced = None
            return wait.reason
        return None


class TrainerSlot(Protocol):
    """A planned trainer as the bookkeeping reads it (`trainer_fleet.TrainerSlot`)."""

    trainer_id: str
    config: TrainerConfig
    key: tuple[Any, ...]   # its `TrainerKey` (cluster_plan.py): the kind's index second
    retired: bool
    status: Any            # its last TrainerStatus (None: not ready)
    error: str | None
    placement: Placement


def _why(slot: TrainerSlot) -> str | None:
    """Why a trainer does not run: it failed to start, or waits for a node (None: ready or starting)."""
    unplaced = slot.placement.unplaced
    return slot.error or (unplaced.reason if unplaced else None)


def all_settled(slots: Iterable[TrainerSlot]) -> bool:
    """Whether every trainer has loaded its model, failed to, was retired (it never starts again), or is known
    unplaceable: no live node holds it, and the cluster's autoscaler answered that none may be added (a node joined
    by hand could: placement_waits.py). One whose autoscaler could not be asked is waited for."""
    return all(s.status is not None or s.error or s.retired or (s.placement.unplaced and s.placement.unplaced.settled)
               for s in slots)


def unplanned(slots: Iterable[TrainerSlot], kinds: list[TrainerConfig], nodes: list[NodeInfo]) -> str | None:
    """Why kinds that no live node can hold have no trainer (`nodes: each` kinds: none is started), and what to do;
    None where each kind has one (running, starting or waiting to be placed)."""
    planned = {s.key[1] for s in slots if not s.retired and s.key}
    missing = [index for index in range(len(kinds)) if index not in planned]
    return none_planned(kinds, nodes, missing, everything=not planned) if missing else None


def waits_by_base(slots: list[TrainerSlot], kinds: list[TrainerConfig],
                  nodes: list[NodeInfo]) -> dict[tuple[str, str], str]:
    """Why the jobs of a base model and quantization that no trainer holds or loads wait: each of its trainers'
    reason (failed, or waiting for a node) and, for a kind of it that has no trainer, why (`unplanned`)."""
    live = [s for s in slots if not s.retired]
    whys: dict[tuple[str, str], list[str | None]] = {}
    for slot in live:
        why = _why(slot)
        whys.setdefault((slot.config.base_model, slot.config.quantization), []).append(
            why and f"trainer {slot.trainer_id} {why}")
    planned = {s.key[1] for s in live if s.key}
    for index, kind in enumerate(kinds):
        if index not in planned and (why := none_planned(kinds, nodes, [index], everything=not planned)):
            whys.setdefault((kind.base_model, kind.quantization), []).append(why)
    return {base: "; ".join(why for why in reasons if why) for base, reasons in whys.items() if all(reasons)}


def why_none_runs(slots: list[TrainerSlot], kinds: list[TrainerConfig], nodes: list[NodeInfo]) -> str | None:
    """Why no trainer can take a job, when every one failed to start or waits for a node (and none is ready), or
    none is planned (no node has what its kinds need); else None."""
    if not slots:
        return none_planned(kinds, nodes, range(len(kinds)))
    broken = [s for s in slots if _why(s)]
    if not broken or any(s.status is not None for s in slots):
        return None
    return "; ".join(f"trainer {s.trainer_id} {_why(s)}" for s in broken)
