"""A pipeline trainer's stages on Ray: stage 0 runs in the trainer actor; every other stage is a `StageActor`
in a placement group the trainer reserves for them (`stage_placement`: PACK, STRICT_PACK on one node, or
SPREAD over nodes), each with its share of the trainer's resources (`num_cpus`, `num_gpus` per stage).
The stages meet stage 0 at its node's address, as Ray Train's workers meet theirs, and pass activations
over torch.distributed (NCCL between GPUs, gloo on CPU): never through Ray's object store.

A stage actor that dies (killed, its node lost) ends its `run` call with an error; the trainer's next
exchange with it then fails and the pipeline names the stage (`StageLost`), after which the trainer starts
new stage actors in the same placement group and its jobs resume from their checkpoints."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.niceness import normal_priority
from actors.service.pipeline.pipeline_processes import StageLaunch, run_stage

log = logging.getLogger(__name__)

PLACEMENT_WAIT_S = 120.0   # how long the stages' placement group may take to be placed before the trainer fails


@ray.remote(max_restarts=0)
class StageActor:
    """One pipeline stage (rank >= 1): loads its share of the base and runs the head's messages until told
    to stop (`run` returns) or until it fails (`run` raises, with the stage's traceback)."""

    def run(self, launch: StageLaunch) -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        normal_priority()
        run_stage(launch)


class RayStage:
    """A running stage actor, watched as a stage process is (`StageHandle`)."""

    def __init__(self, name: str, actor: Any, run: ray.ObjectRef):
        self.name = name
        self.actor = actor
        self.run = run

    def is_alive(self) -> bool:
        return not ray.wait([self.run], timeout=0)[0]

    @property
    def exitcode(self) -> int | None:
        """None while it runs, 0 once it stopped as told, 1 once it failed (or its actor died)."""
        if self.is_alive():
            return None
        try:
            ray.get(self.run)
        except RayError as error:
            log.error("%s ended: %s", self.name, error)
            return 1
        return 0

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.run], timeout=timeout)

    def kill(self) -> None:
        try:
            ray.kill(self.actor)
        except RayError as error:   # already gone
            log.info("%s: %s", self.name, error)


class RayStageStarter:
    """Starts stages 1..S-1 as `StageActor`s in a placement group of one bundle per stage; `close` frees it."""

    def __init__(self, name: str, stages: int, *, num_cpus: float, num_gpus: float, strategy: str = "PACK",
                 memory: int = 0):
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **({"memory": memory} if memory else {})}
        self.name = name
        self.num_cpus, self.num_gpus, self.memory = num_cpus, num_gpus, memory
        self.started = 0
        self.group = placement_group([dict(bundle) for _ in range(stages - 1)], strategy=strategy,
                                     name=f"{name}.stages")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_WAIT_S)
        except GetTimeoutError as error:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"trainer {name}: its {stages - 1} other pipeline stages ({bundle} each, {strategy}) could not be "
                f"placed within {PLACEMENT_WAIT_S:.0f}s: the cluster lacks those resources; add nodes, lower "
                "num_cpus / num_gpus, or use stage_placement: pack or spread") from error

    def __call__(self, launch: StageLaunch) -> RayStage:
        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=launch.rank - 1)
        self.started += 1
        actor = StageActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy,
                                   **({"memory": self.memory} if self.memory else {}),
                                   name=f"{self.name}.stage-{launch.rank}.{self.started}").remote()
        return RayStage(f"stage actor {launch.rank}", actor, actor.run.remote(launch))

    def close(self) -> None:
        remove_placement_group(self.group)


def node_address() -> str:
    """This node's address as the other stages reach it."""
    return ray.util.get_node_ip_address()
