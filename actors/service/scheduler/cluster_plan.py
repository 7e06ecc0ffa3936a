"""Which trainers a service runs on which nodes of its Ray cluster (Ray-free: the scheduler actor reads the
nodes from Ray and carries the plan out).

A trainer kind (`TrainerConfig`) with `nodes: each` has trainers on every live node that has their
resources: `count` per node (GPU kinds at most one per `num_gpus` of the node's GPUs). A kind with
`nodes: any` has `count` trainers spread over the nodes: each goes to the node with the most of the
kind's resource left after what is planned there already, and stays on its node while that node lives
(a trainer whose node is lost is planned on a live one). The default (no kinds configured): one trainer per
GPU of every node with GPUs, or on a cluster without GPUs `cpu_trainers_per_node` CPU trainers on every
node.

Each CPU trainer's torch threads are its node's CPUs shared among the CPU trainers planned on that node
(unless the kind sets `threads`): sized from its own node, not from the scheduler's. A pipeline trainer
(`stages: N`) counts as its N stages on its node (N times its resources, N sharers of the CPUs; with
`stage_placement: spread`, stage 0 only: the others go to other nodes). Their default memory budgets share the
node's RAM likewise (`ram_share`: each CPU trainer's process plans for half the RAM over the CPU trainers' processes
on its node, where each alone would plan for half of it: together they would overcommit it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from actors.service.scheduler.config import ServiceConfig, TrainerConfig

ONE_PER_GPU = 1024   # `count` of the default GPU kind: as many as the node has GPUs


@dataclass(frozen=True)
class NodeInfo:
    """A live node of the cluster, as the plan needs it."""

    id: str
    address: str
    cpus: float
    gpus: float
    head: bool = False
    memory_bytes: float = 0.0   # Ray's `memory` resource: what it lets tasks and actors use


# ("each", kind index, node id, index on the node) or ("any", kind index, index)
TrainerKey = tuple


@dataclass(frozen=True)
class PlannedTrainer:
    key: TrainerKey
    config: TrainerConfig
    node: str | None          # the node it is pinned to (None: no live node has its resources)
    threads: int | None       # torch CPU threads (None: torch's default, e.g. on a GPU trainer)
    ram_share: float = 1.0    # a CPU trainer's share of its node's RAM for its default budget (one process's)


def trainer_kinds(config: ServiceConfig, cluster_has_gpus: bool) -> list[TrainerConfig]:
    """The configured kinds, or the default for a cluster with or without GPUs (decided once, at start)."""
    if config.trainers:
        return list(config.trainers)
    if cluster_has_gpus:
        return [TrainerConfig(num_gpus=1, nodes="each", count=ONE_PER_GPU)]
    return [TrainerConfig(nodes="each", count=config.cpu_trainers_per_node)]


def _on_its_node(kind: TrainerConfig) -> int:
    """How many processes of a trainer run on the node it is pinned to: its pipeline stages, unless they are
    spread over nodes (then stage 0 only is sure to be there); 1 for a single-device trainer."""
    return 1 if kind.stage_placement == "spread" else kind.stages


def demand(kind: TrainerConfig) -> tuple[float, float]:
    """The CPUs and GPUs a trainer takes on its node (a pipeline's: every stage placed with it)."""
    return kind.num_cpus * _on_its_node(kind), kind.num_gpus * _on_its_node(kind)


def host_memory(kind: TrainerConfig) -> int:
    """The bytes of Ray's `memory` a trainer's actor asks for (and each of its pipeline's other stages): a CPU trainer's
    `memory_budget_bytes` where it sets one (its steps are planned to fill it); else none. A GPU trainer's budget is
    the GPU's memory, and what it holds on the host (the base on its way to the GPU) is not known before it loads; a CPU
    trainer's default budget is its share of half the RAM of the node it starts on, sized to that node."""
    return (kind.memory_budget_bytes or 0) if kind.num_gpus == 0 else 0


def fits(kind: TrainerConfig, node: NodeInfo) -> bool:
    cpus, gpus = demand(kind)
    return (node.cpus >= cpus and node.gpus >= gpus and (kind.num_gpus > 0 or node.cpus > 0)
            and node.memory_bytes >= host_memory(kind) * _on_its_node(kind))


def _per_node(kind: TrainerConfig, node: NodeInfo) -> int:
    if not fits(kind, node):
        return 0
    if kind.num_gpus > 0:
        return min(kind.count, int(node.gpus // demand(kind)[1] + 1e-9))
    return kind.count


def plan_trainers(kinds: Sequence[TrainerConfig], nodes: Sequence[NodeInfo],
                  current: Mapping[TrainerKey, str | None] | None = None) -> list[PlannedTrainer]:
    """The trainers to run on these live `nodes`. `current`: where the running trainers are (key -> node id);
    a trainer of an `any` kind stays where it is while its node lives."""
    current = current or {}
    alive = {node.id: node for node in nodes}
    placed: list[tuple[TrainerKey, TrainerConfig, str | None]] = []
    used_cpus = {node.id: 0.0 for node in nodes}
    used_gpus = {node.id: 0.0 for node in nodes}

    def book(key: TrainerKey, kind: TrainerConfig, node_id: str | None) -> None:
        placed.append((key, kind, node_id))
        if node_id is not None:
            cpus, gpus = demand(kind)
            used_cpus[node_id] += cpus
            used_gpus[node_id] += gpus

    for index, kind in enumerate(kinds):
        if kind.nodes == "each":
            for node in nodes:
                for i in range(_per_node(kind, node)):
                    book(("each", index, node.id, i), kind, node.id)
    for index, kind in enumerate(kinds):
        if kind.nodes != "any":
            continue
        for i in range(kind.count):
            key = ("any", index, i)
            node_id = current.get(key)
            if node_id not in alive:
                node_id = _roomiest(kind, nodes, used_cpus, used_gpus)
            book(key, kind, node_id)

    cpu_trainers: dict[str, int] = {}
    for _, kind, node_id in placed:
        if node_id is not None and kind.num_gpus == 0:   # a pipeline's stages each compute on their own threads
            cpu_trainers[node_id] = cpu_trainers.get(node_id, 0) + _on_its_node(kind)
    plan = []
    for key, kind, node_id in placed:
        threads, ram_share = kind.threads, 1.0
        if kind.num_gpus == 0 and node_id is not None:
            ram_share = 1 / cpu_trainers[node_id]
            if threads is None:
                threads = max(1, int(alive[node_id].cpus) // cpu_trainers[node_id])
        plan.append(PlannedTrainer(key, kind, node_id, threads, ram_share))
    return plan


def _roomiest(kind: TrainerConfig, nodes: Sequence[NodeInfo], used_cpus: dict[str, float],
              used_gpus: dict[str, float]) -> str | None:
    """The live node with the most of the kind's resource left (GPUs for a GPU kind, else CPUs), among those
    where it still fits; else the one with the most left (Ray starts it there once resources free up);
    None without a node that has the resource at all."""
    def left(node: NodeInfo) -> tuple[float, float]:
        gpus, cpus = node.gpus - used_gpus[node.id], node.cpus - used_cpus[node.id]
        return (gpus, cpus) if kind.num_gpus > 0 else (cpus, -node.gpus)   # CPU kinds: CPU-only nodes first

    candidates = [node for node in nodes if fits(kind, node)]
    if not candidates:
        return None
    cpus, gpus = demand(kind)
    fitting = [node for node in candidates
               if node.cpus - used_cpus[node.id] >= cpus and node.gpus - used_gpus[node.id] >= gpus]
    return max(fitting or candidates, key=lambda node: (left(node), node.head, node.id)).id
