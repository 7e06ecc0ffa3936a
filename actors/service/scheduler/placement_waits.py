"""Why a trainer Ray cannot place waits, said where users look (Ray-free: the fleet asks, `actors/ray_trainers.py`
answers what Ray's autoscaler knows).

A trainer actor asks Ray for `num_cpus` and `num_gpus` (a pipeline's stages too, on its node unless spread: the
plan's demand, cluster_plan.py), and a CPU trainer that sets `memory_budget_bytes` for that much `memory` (Ray's
resource: each node's share of its RAM; `host_memory`). On a cluster none of whose live nodes has that much
(`device: cuda` or `num_gpus` on a cluster without a GPU node, more CPUs or memory than any node has), Ray keeps the
actor pending for ever, and the trainer showed "starting its process" while its jobs stayed queued. Now, once a
trainer has waited `PLACEMENT_WAIT_S` unstarted, the fleet compares its demand with the live nodes every
`cluster_poll_s`; where none could ever hold it, its phase (`aspen status`, the HTTP API's service description, the
console's trainer card) and its queued jobs' reason say what is missing and what to do. It keeps waiting (a node that
has it may join: `ray start --address`, or an autoscaler may add one), unless the cluster's autoscaler says the
demand is infeasible for every node type it can start: then the trainer fails with that reason (and its pending
actor is ended). Where no autoscaler may add a node (`grows` false), the service's `wait_ready` (what `aspen run`
and `aspen serve` wait in) ends without waiting for it: only a node joined by hand could place it. Where what the
autoscaler says could not be read (Ray's GCS failed or timed out: `AutoscalingUnknown`), that is not taken for "no
autoscaler": the trainer's reason says the check could not be made and why, the wait goes on, and the check is made
again at the next look; only an answer ends the wait."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from actors.service.scheduler.cluster_plan import NodeInfo, demand, fits, host_memory
from actors.service.scheduler.config import TrainerConfig


def _placement_wait_s() -> float:
    """ASPEN_PLACEMENT_WAIT_S where set (in the environment of the process the scheduler runs in: the one that
    starts the Ray cluster passes it on to its workers), else 10 s; ValueError naming the variable where it is not a
    number > 0."""
    said = os.environ.get("ASPEN_PLACEMENT_WAIT_S", "10")
    try:
        seconds = float(said)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"ASPEN_PLACEMENT_WAIT_S={said!r}: not a number of seconds > 0; set it to one (say 10, the "
                         "default) or unset it")
    return seconds


# seconds a trainer waits unstarted before its placement is looked at (then every cluster_poll_s): 10 s, or
# ASPEN_PLACEMENT_WAIT_S (the test session's is 2 s: tests/conftest.py)
PLACEMENT_WAIT_S = _placement_wait_s()

# what Ray says of a trainer's demand: no longer pending (its actor was placed); else what the cluster's autoscaler
# says: none runs; one runs and may add a node for it; it says no node type it can start holds it
Autoscaling = Literal["placed", "none", "may_grow", "infeasible"]


class AutoscalingUnknown(RuntimeError):
    """What Ray says of a demand could not be read (its GCS failed or did not answer in time), or is not known yet
    (`pending`: the GCS was asked and has not answered, or the cluster's autoscaler has not reported to it yet):
    unknown, not "none"."""

    def __init__(self, message: str, pending: bool = False):
        super().__init__(message)
        self.pending = pending


@dataclass(frozen=True)
class PlacementWait:
    """Why a trainer cannot be placed now: `reason` for its phase and its jobs; `final` where it never can; `grows`
    where the cluster's autoscaler may add a node that holds it (else only a node joined by hand could); `unknown`
    where whether one may could not be asked (asked again at the next look)."""

    reason: str
    final: bool
    grows: bool = False
    unknown: bool = False

    @property
    def settled(self) -> bool:
        """Whether the wait for the trainer may end: the cluster's autoscaler answered, and none may add a node."""
        return not self.grows and not self.unknown


def actor_resources(config: TrainerConfig) -> dict[str, float]:
    """The resources a trainer of `config` asks Ray for its actor, by Ray's names (as its autoscaler lists demands)."""
    return {name: float(value) for name, value in (("CPU", config.num_cpus), ("GPU", config.num_gpus),
                                                   ("memory", host_memory(config))) if value > 0}


def gib(count: float) -> str:
    return f"{count / 2**30:.1f} GiB"


def missing(config: TrainerConfig, nodes: list[NodeInfo]) -> str | None:
    """What no live node has for a trainer of `config` (None where one could hold it, busy or not)."""
    if any(fits(config, node) for node in nodes):
        return None
    cpus, gpus = demand(config)
    on_node = 1 if config.stage_placement == "spread" else config.stages
    memory = host_memory(config) * on_node
    stages = f" ({config.stages} pipeline stages on one node)" if on_node > 1 else ""
    most_gpus = max((node.gpus for node in nodes), default=0)
    most_cpus = max((node.cpus for node in nodes), default=0)
    most_memory = max((node.memory_bytes for node in nodes), default=0)
    if gpus and most_gpus == 0:
        return f"no node of the cluster has a GPU: device: cuda (or num_gpus) asks for one per trainer{stages}"
    if gpus > most_gpus:
        return f"no node of the cluster has {gpus:g} GPUs{stages} (the most a node has: {most_gpus:g})"
    if cpus > most_cpus:
        return (f"no node of the cluster has {cpus:g} CPUs{stages} (num_cpus: {config.num_cpus:g}; the most a node "
                f"has: {most_cpus:g})")
    what = (f"{gib(memory)} of memory{stages} (memory_budget_bytes: {config.memory_budget_bytes}: a CPU trainer asks "
            f"Ray for its budget as `memory`; the most a node has: {gib(most_memory)})")
    if memory > most_memory:
        return f"no node of the cluster has {what}"
    return f"no node of the cluster has all it asks at once: {cpus:g} CPUs, {gpus:g} GPUs and {what}"


def _fix(config: TrainerConfig, nodes: list[NodeInfo]) -> str:
    """What to do where no node holds a trainer of `config`: add a node that has it, or ask less of what it lacks."""
    cpus, gpus = demand(config)
    kind = "of the service's trainers: kind (`aspen serve --config FILE`)"
    if gpus > max((node.gpus for node in nodes), default=0):
        less = f"device: cpu or auto in a jobs file (`aspen run`), num_gpus / num_cpus {kind}"
    elif cpus > max((node.cpus for node in nodes), default=0) or not host_memory(config):
        less = f"num_cpus {kind}"
    else:
        less = (f"memory_budget_bytes {kind}; left out, a CPU trainer plans for its share of half its node's RAM and "
                "asks Ray for no memory")
    return f"add a node that has it (`ray start --address=<head>:6379` on such a machine), or ask for less: {less}"


def placement_wait(config: TrainerConfig, nodes: list[NodeInfo], autoscaling: Autoscaling) -> PlacementWait | None:
    """Why a trainer of `config` cannot be placed on these live `nodes`, and what to do; None where a node could hold
    it (it waits for one's resources to free, or is starting)."""
    lack = missing(config, nodes)
    if lack is None or autoscaling == "placed":
        return None
    fix = _fix(config, nodes)
    if autoscaling == "infeasible":
        return PlacementWait(f"cannot be placed: {lack}, and the cluster's autoscaler has no node type that has it; "
                             f"{fix}, then restart the service", True)
    grows = ("the cluster's autoscaler may add such a node: waiting for it" if autoscaling == "may_grow"
             else "it starts once a node that has it joins")
    return PlacementWait(f"waiting for a node: {lack}; {grows}; else {fix}", False, autoscaling == "may_grow")


def look_at_placement(config: TrainerConfig, nodes: list[NodeInfo],
                      autoscaling: Callable[[dict[str, float]], Autoscaling]) -> PlacementWait | None:
    """`placement_wait` of a trainer unstarted a while: the autoscaler (`autoscaling(its actor's resources)`, a
    call to Ray's GCS) is asked only where no live node could hold it. Where it cannot be asked
    (`AutoscalingUnknown`), the trainer waits, saying so and why: its wait ends only on an answer."""
    lack = missing(config, nodes)
    if lack is None:
        return None
    try:
        answer = autoscaling(actor_resources(config))
    except AutoscalingUnknown as error:
        unknown = "is not known yet" if error.pending else "could not be asked"
        return PlacementWait(f"waiting for a node: {lack}; whether the cluster's autoscaler may add one {unknown} "
                             f"({error}): waiting, asked again at the next look (cluster_poll_s); else "
                             f"{_fix(config, nodes)}", False, unknown=True)
    return placement_wait(config, nodes, answer)


def none_planned(kinds: list[TrainerConfig], nodes: list[NodeInfo], indices: Iterable[int],
                 everything: bool = True) -> str | None:
    """Why the service runs no trainer of the kinds at `indices` on these live `nodes` (`nodes: each` kinds no node
    has what they need for: none is started), and what to do; `everything`: it runs no trainer at all. None where
    none of them lacks a node."""
    lacks = [f"trainers[{index}] ({kinds[index].base_model}): {lack}" for index in indices
             if (lack := missing(kinds[index], nodes)) is not None]
    if not lacks or not nodes:
        return None
    return (f"no trainer runs{':' if everything else ' for'} {'; '.join(lacks)}; they start on each node that has it "
            "as it joins (`ray start --address=<head>:6379` on such a machine), or give the service's trainers less "
            "(num_gpus / num_cpus / memory_budget_bytes) and restart it")
