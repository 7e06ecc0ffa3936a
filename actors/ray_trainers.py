"""The trainers on Ray, behind the `TrainerHandles` interface of the Ray-free trainer fleet: live nodes,
`TrainerActor`s pinned to their nodes, and their calls, whose Ray errors surface as `TrainerCallFailed`.

`TrainerUnavailable` is raised where Ray says the trainer may come back (`ActorUnavailableError`)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.service.scheduler.cluster_plan import NodeInfo
from actors.service.scheduler.config import NAMESPACE, StorageConfig, TrainerConfig
from actors.service.scheduler.trainer_fleet import TrainerCallFailed, TrainerUnavailable
from actors.service.trainer.job_link import Assignment
from actors.trainer_actor import TrainerActor


def alive_nodes() -> list[NodeInfo]:
    """The cluster's live nodes, the head first."""
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources") or {}
        nodes.append(NodeInfo(id=node["NodeID"], address=node.get("NodeManagerAddress", ""),
                              cpus=float(resources.get("CPU", 0)), gpus=float(resources.get("GPU", 0)),
                              head="node:__internal_head__" in resources,
                              memory_bytes=float(resources.get("memory", 0))))
    return sorted(nodes, key=lambda n: (not n.head, n.id))


def head_node_id() -> str | None:
    """The head node of the cluster this process is connected to (where the service's scheduler lives)."""
    return next((node.id for node in alive_nodes() if node.head), None)


def call_failed(error: RayError) -> TrainerCallFailed:
    kind = TrainerUnavailable if isinstance(error, ActorUnavailableError) else TrainerCallFailed
    return kind(type(error).__name__, getattr(error, "cause", error))


class RefCall:
    """A `TrainerCall` on a Ray object ref."""

    def __init__(self, ref: ray.ObjectRef):
        self.ref = ref

    def done(self) -> bool:
        return bool(ray.wait([self.ref], timeout=0)[0])

    def result(self, timeout: float | None = None) -> Any:
        try:
            return ray.get(self.ref, timeout=timeout)
        except RayError as error:   # also GetTimeoutError, RayActorError, a RayTaskError from the trainer
            raise call_failed(error) from error


class RayTrainers:
    """`TrainerHandles` on Ray, for a scheduler actor: trainers named `<service>.<trainer>.<incarnation>.<n>`."""

    def __init__(self, incarnation: str, state_dir: str, policy: str, storage: StorageConfig):
        self.incarnation = incarnation
        self.state_dir = state_dir
        self.policy = policy
        self.storage = storage

    def nodes(self) -> list[NodeInfo]:
        return alive_nodes()

    def launch(self, trainer_id: str, attempt: int, config: TrainerConfig, node: str | None,
               threads: int | None, ram_share: float = 1.0) -> tuple[Any, str]:
        scheduler = ray.get_runtime_context().get_actor_name()
        service = scheduler or "aspen"
        name = f"{service}.{trainer_id}.{self.incarnation}.{attempt}"
        options: dict[str, Any] = {"num_cpus": config.num_cpus, "num_gpus": config.num_gpus, "name": name,
                                   "namespace": NAMESPACE}
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        handle = TrainerActor.options(**options).remote(trainer_id, config, self.state_dir,
                                                        threads, self.policy, storage=self.storage,
                                                        scheduler=scheduler, ram_share=ram_share)
        return handle, name

    def start(self, handle: Any) -> RefCall:
        return RefCall(handle.start.remote())

    def poll(self, handle: Any) -> RefCall:
        return RefCall(handle.poll.remote())

    def assign(self, handle: Any, assignments: list[Assignment]) -> None:
        handle.assign.remote(assignments)

    def stop_job(self, handle: Any, job: str, kind: str, reason: str) -> None:
        handle.stop_job.remote(job, kind, reason)

    def generate(self, handle: Any, job: str, prompt: str, max_new_tokens: int, ticket: str | None) -> RefCall:
        return RefCall(handle.generate.remote(job, prompt, max_new_tokens, ticket))

    def try_saved(self, handle: Any, job: str, spec: Any, location: str, step: int, prompt: str,
                  max_new_tokens: int, ticket: str | None) -> RefCall:
        return RefCall(handle.try_saved.remote(job, spec, location, step, prompt, max_new_tokens, ticket))

    def shutdown(self, handle: Any) -> RefCall:
        return RefCall(handle.shutdown.remote())

    def kill(self, handle: Any) -> None:
        try:
            ray.kill(handle)
        except RayError as error:
            raise call_failed(error) from error
