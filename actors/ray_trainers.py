"""The trainers on Ray, behind the `TrainerHandles` interface of the Ray-free trainer fleet: live nodes,
`TrainerActor`s pinned to their nodes, and their calls, whose Ray errors surface as `TrainerCallFailed`.

`TrainerUnavailable` is raised where Ray says the trainer may come back (`ActorUnavailableError`). Whether Ray still
holds a trainer's demand pending, and what the cluster's autoscaler says of one no live node can hold (`autoscaling`),
are read from the GCS: its pending resource requests, the autoscaling state an
autoscaler (v2) reports there, with the demands it found infeasible for every node type it can start; the status a
v1 autoscaler writes to the GCS's key-value store; neither where none runs (a cluster of `ray start` nodes). Where
the GCS cannot be read, `AutoscalingUnknown` says so and why (the trainer keeps waiting: placement_waits.py)."""

from __future__ import annotations

from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.service.scheduler.cluster_plan import NodeInfo, host_memory
from actors.service.scheduler.config import NAMESPACE, StorageConfig, TrainerConfig
from actors.service.scheduler.placement_waits import Autoscaling, AutoscalingUnknown
from actors.service.scheduler.trainer_handles import TrainerCallFailed, TrainerUnavailable
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


def autoscaling(resources: dict[str, float]) -> Autoscaling:
    """What Ray says of an actor asking `resources` (placement_waits.py): "placed" where its GCS lists no such demand
    pending; else what the cluster's autoscaler says of it: "none" where none runs, or only the read-only one every
    head node starts (it mirrors the live nodes, each its own node type: a cluster of `ray start` nodes, which grows
    only by hand). AutoscalingUnknown where the GCS could not be asked (it failed or timed out): unknown is not
    "none" (the trainer keeps waiting, asked again)."""
    import json

    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray._raylet import GcsClient
    from ray.autoscaler._private.util import format_readonly_node_type
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    address = ray.get_runtime_context().gcs_address
    try:
        reply = GetClusterStatusReply()
        reply.ParseFromString(GcsClient(address).get_cluster_status(timeout_s=10))
        pending = reply.cluster_resource_state.pending_resource_requests
        if resources not in [dict(demand.request.resources_bundle) for demand in pending]:
            return "placed"
        if reply.HasField("autoscaling_state"):   # an autoscaler (v2) reports here
            types = {node.node_id.hex(): node.ray_node_type_name for node in reply.cluster_resource_state.node_states}
            if _read_only(types, format_readonly_node_type):
                return "none"
            infeasible = [dict(request.resources_bundle) for request in
                          reply.autoscaling_state.infeasible_resource_requests]
            return "infeasible" if resources in infeasible else "may_grow"
        status = _internal_kv_get(DEBUG_AUTOSCALING_STATUS) if _internal_kv_initialized() else None
        if status:   # a v1 autoscaler's status
            report = json.loads(status).get("autoscaler_report") or {}
            return "none" if _read_only(report.get("node_type_mapping") or {}, format_readonly_node_type) \
                else "may_grow"
    except Exception as error:   # Ray's GCS client raises its own kinds (RpcError on a timeout), a bad reply others:
        # said in the trainer's reason (logged by the fleet as it changes)
        raise AutoscalingUnknown(f"Ray's GCS at {address}: {type(error).__name__}: {error}") from error
    return "none"


def _read_only(types: dict[str, str], readonly_name: Any) -> bool:
    """Whether each node's type is the one Ray's read-only autoscaler names after the node itself."""
    return all(name == readonly_name(node) for node, name in types.items())


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
        if host_memory(config):   # a CPU trainer's budget: placed on a node whose `memory` has it (placement_waits.py)
            options["memory"] = host_memory(config)
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        handle = TrainerActor.options(**options).remote(trainer_id, config, self.state_dir,
                                                        threads, self.policy, storage=self.storage,
                                                        scheduler=scheduler, ram_share=ram_share)
        return handle, name

    def autoscaling(self, resources: dict[str, float]) -> Autoscaling:
        return autoscaling(resources)

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
