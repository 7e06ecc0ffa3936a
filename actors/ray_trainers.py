"""The trainers on Ray, behind the `TrainerHandles` interface of the Ray-free trainer fleet: live nodes,
`TrainerActor`s pinned to their nodes, and their calls, whose Ray errors surface as `TrainerCallFailed`.

`TrainerUnavailable` is raised where Ray says the trainer may come back (`ActorUnavailableError`). Whether Ray still
holds a trainer's demand pending, and what the cluster's autoscaler says of one no live node can hold (`autoscaling`),
are read from the GCS: its pending resource requests, the autoscaling state an
autoscaler (v2) reports there, with the demands it found infeasible for every node type it can start; the status a
v1 autoscaler writes to the GCS's key-value store; neither where none runs (a cluster of `ray start` nodes). Where
the GCS cannot be read, `AutoscalingUnknown` says so and why (the trainer keeps waiting: placement_waits.py). The GCS is
asked from a thread of its own (`GcsAsker`), the scheduler's tick reading its last answer: a GCS that times out
does not hold the tick, nor the client calls waiting on the service's lock. So are the live nodes (`NodeReader`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
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

log = logging.getLogger(__name__)


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


class NodeReader:
    """The live nodes read from a thread of its own (`ray.nodes()`, a call to Ray's GCS), one read in flight at most:
    `nodes` (the fleet's look, every cluster_poll_s under the service's lock) returns the last answer and starts the
    next read, never waiting on the GCS (a slow GCS held the tick and every client call). The first read too: until
    its answer comes, `nodes` returns None (the fleet says it is reading the cluster's nodes; it planned on a read made
    in the call, which held the service's lock as long as the GCS took). A node that joins is seen within two looks
    (each uses the read the one before started). A read that fails is logged, the last answer kept."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reading = False
        self.answer: list[NodeInfo] | None = None

    def nodes(self) -> list[NodeInfo] | None:
        with self.lock:
            if not self.reading:
                self.reading = True
                threading.Thread(target=self._read, name="aspen-node-read", daemon=True).start()
            return self.answer

    def read_now(self) -> list[NodeInfo]:
        """The live nodes read now, in the call (a trainer's call failed: whether its node left decides what its
        jobs are told, and the last read may predate the node's death); kept as the last answer."""
        answer = alive_nodes()
        with self.lock:
            self.answer = answer
        return answer

    def _read(self) -> None:
        try:
            answer = alive_nodes()
        except Exception as error:  # noqa: BLE001 - Ray's GCS client raises its own kinds: the last answer kept
            log.warning("scheduler: reading the cluster's nodes from Ray's GCS failed: %s: %s",
                        type(error).__name__, error)
            answer = None
        with self.lock:
            self.reading = False
            if answer is not None:
                self.answer = answer


GCS_TIMEOUT_S = 10.0   # each call to Ray's GCS (from the asking thread: the scheduler's tick never waits on one)
# after the cluster's head node started, an autoscaler that has not reported to the GCS yet (it reports every few
# seconds once it runs) may still: until then its silence is not taken for "no autoscaler" (docs/cluster.md)
AUTOSCALER_GRACE_S = 30.0
# a cluster aspen started itself (orchestrator/private_ray.py) stops Ray's autoscaler monitor and says so in its GCS's
# key-value store under this key: there no autoscaler will report, and the grace is not waited
NO_AUTOSCALER_KEY, NO_AUTOSCALER_NAMESPACE = b"no_autoscaler", b"aspen"


@dataclass(frozen=True)
class GcsAnswer:
    """What Ray's GCS said of the cluster's autoscaling, in one ask: its cluster status (a
    `GetClusterStatusReply`), the status a v1 autoscaler writes to its key-value store (None: none written), whether
    the cluster runs the v2 autoscaler (its GCS's `GCS_AUTOSCALER_V2_ENABLED_KEY`, as `ray.autoscaler.v2.utils.
    is_autoscaler_v2` reads it), when its head node started (Unix seconds; None: not listed), and whether the cluster
    says no autoscaler runs there (NO_AUTOSCALER_KEY: one aspen started)."""

    reply: Any
    v1_status: bytes | None
    v2: bool
    head_started: float | None
    at: float   # when it was asked (Unix seconds)
    no_autoscaler: bool = False


def ask_gcs(address: str) -> GcsAnswer:
    """Ask the GCS at `address` (each call bounded by GCS_TIMEOUT_S); Ray's errors raised as they come."""
    from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
    from ray._raylet import GCS_AUTOSCALER_STATE_NAMESPACE, GCS_AUTOSCALER_V2_ENABLED_KEY, GcsClient
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    at = time.time()
    gcs = GcsClient(address)
    reply = GetClusterStatusReply()
    reply.ParseFromString(gcs.get_cluster_status(timeout_s=GCS_TIMEOUT_S))
    v1_status = gcs.internal_kv_get(DEBUG_AUTOSCALING_STATUS.encode(), None, timeout=GCS_TIMEOUT_S)
    v2 = gcs.internal_kv_get(GCS_AUTOSCALER_V2_ENABLED_KEY.encode(), GCS_AUTOSCALER_STATE_NAMESPACE.encode(),
                             timeout=GCS_TIMEOUT_S) == b"1"
    heads = [node.start_time_ms / 1000 for node in gcs.get_all_node_info(timeout=GCS_TIMEOUT_S).values()
             if node.is_head_node and node.start_time_ms]
    no_autoscaler = gcs.internal_kv_get(NO_AUTOSCALER_KEY, NO_AUTOSCALER_NAMESPACE, timeout=GCS_TIMEOUT_S) == b"1"
    return GcsAnswer(reply, v1_status or None, v2, max(heads, default=None), at, no_autoscaler)


def read_autoscaling(answer: GcsAnswer, resources: dict[str, float], address: str) -> Autoscaling:
    """What Ray says of an actor asking `resources` (placement_waits.py): "placed" where its GCS lists no such demand
    pending; else what the cluster's autoscaler says of it: "none" where none runs, or only the read-only one every
    head node starts (it mirrors the live nodes, each its own node type: a cluster of `ray start` nodes, which grows
    only by hand). Where no autoscaler has reported (no v2 autoscaling state, no v1 status) within
    AUTOSCALER_GRACE_S of the head node's start, one may not have yet: AutoscalingUnknown (waited for, asked
    again), "none" after it (and where the GCS lists no head node's start, or the cluster says none runs there)."""
    import json

    from ray.autoscaler._private.util import format_readonly_node_type

    reply = answer.reply
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
    if answer.v1_status:   # a v1 autoscaler's status
        report = json.loads(answer.v1_status).get("autoscaler_report") or {}
        return "none" if _read_only(report.get("node_type_mapping") or {}, format_readonly_node_type) else "may_grow"
    if answer.no_autoscaler:   # a cluster aspen started, its autoscaler monitor stopped: none will report
        return "none"
    since = answer.at - answer.head_started if answer.head_started is not None else AUTOSCALER_GRACE_S
    if since < AUTOSCALER_GRACE_S:   # (no start listed: nothing to count the grace from, read as after it)
        raise AutoscalingUnknown(
            f"Ray's GCS at {address}: no {'v2 ' if answer.v2 else ''}autoscaler has reported yet, {since:.0f}s after "
            f"the cluster's head node started; one that runs reports within {AUTOSCALER_GRACE_S:.0f}s of it",
            pending=True)
    return "none"


class GcsAsker:
    """Ray's GCS asked from a thread of its own, one ask in flight at most: `autoscaling` (the scheduler's tick, under
    the service's lock) reads the last answer and starts the next ask, never waiting on the GCS (a GCS that times
    out held the tick and every client call for GCS_TIMEOUT_S at each look). Until an answer younger than
    `max_age_s` has come, or where the last ask failed, the demand's autoscaling is unknown (AutoscalingUnknown:
    the trainer keeps waiting)."""

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self.lock = threading.Lock()
        self.asking = False
        self.answer: GcsAnswer | None = None
        self.error: str | None = None

    def autoscaling(self, resources: dict[str, float]) -> Autoscaling:
        address = ray.get_runtime_context().gcs_address
        with self.lock:
            answer, error = self.answer, self.error
            if not self.asking:
                self.asking = True
                threading.Thread(target=self._ask, args=(address,), name="aspen-gcs-ask", daemon=True).start()
        if error is not None:
            raise AutoscalingUnknown(error)
        if answer is None or time.time() - answer.at > self.max_age_s:
            raise AutoscalingUnknown(f"Ray's GCS at {address}: asked, no answer yet", pending=True)
        try:
            return read_autoscaling(answer, resources, address)
        except AutoscalingUnknown:
            raise
        except Exception as error:   # a reply not as expected: said in the trainer's reason
            raise AutoscalingUnknown(f"Ray's GCS at {address}: {type(error).__name__}: {error}") from error

    def _ask(self, address: str) -> None:
        try:
            answer, error = ask_gcs(address), None
        except Exception as failed:   # noqa: BLE001 - Ray's GCS client raises its own kinds (RpcError on a
            # timeout): said in the trainer's reason (logged by the fleet as it changes)
            answer, error = None, f"Ray's GCS at {address}: {type(failed).__name__}: {failed}"
        with self.lock:
            self.asking = False
            if answer is not None:
                self.answer = answer
            self.error = error


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

    def __init__(self, incarnation: str, state_dir: str, policy: str, storage: StorageConfig,
                 cluster_poll_s: float = 2.0):
        """`cluster_poll_s`: how often the fleet looks (an answer of the GCS older than two looks is not read)."""
        self.incarnation = incarnation
        self.gcs = GcsAsker(2 * cluster_poll_s + 2 * GCS_TIMEOUT_S)
        self.node_reader = NodeReader()
        self.state_dir = state_dir
        self.policy = policy
        self.storage = storage

    def nodes(self, fresh: bool = False) -> list[NodeInfo] | None:
        return self.node_reader.read_now() if fresh else self.node_reader.nodes()

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
        return self.gcs.autoscaling(resources)

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
