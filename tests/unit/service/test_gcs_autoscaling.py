"""What Ray's GCS answers of a trainer's pending demand, read into what the fleet waits on (actors/ray_trainers.py), on
answers built from Ray's own types (`GetClusterStatusReply`, its autoscaler's status JSON).

Right after a cluster starts, its autoscaler has not reported to the GCS yet: the reply has no `autoscaling_state`
(v2) and the key-value store no status (v1), as where none runs. That silence read as "no autoscaler", so the wait
for a trainer no node holds could end while an autoscaler was about to add a node. Now, within AUTOSCALER_GRACE_S of
the head node's start, it is unknown (the trainer is waited for, asked again); after it, "none"."""

from __future__ import annotations

import json

import pytest
from ray.autoscaler._private.util import format_readonly_node_type
from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

from actors.ray_trainers import AUTOSCALER_GRACE_S, GcsAnswer, read_autoscaling
from actors.service.scheduler.placement_waits import AutoscalingUnknown

GPU = {"CPU": 0.5, "GPU": 1.0}
NODE = "ab" * 28
AT = 1_800_000_000.0


def reply(pending: list[dict[str, float]], node_type: str | None = None,
          infeasible: list[dict[str, float]] = ()) -> GetClusterStatusReply:
    """The GCS's cluster status: `pending` demands; with `node_type`, the autoscaling state a v2 autoscaler reported
    (its one node of that type, `infeasible` the demands it found no node type for)."""
    answer = GetClusterStatusReply()
    for bundle in pending:
        demand = answer.cluster_resource_state.pending_resource_requests.add()
        demand.request.resources_bundle.update(bundle)
        demand.count = 1
    if node_type is not None:
        node = answer.cluster_resource_state.node_states.add()
        node.node_id, node.ray_node_type_name = bytes.fromhex(NODE), node_type
        answer.autoscaling_state.autoscaler_state_version = 1
        for bundle in infeasible:
            answer.autoscaling_state.infeasible_resource_requests.add().resources_bundle.update(bundle)
    return answer


def answer(status: GetClusterStatusReply, *, v1: dict | None = None, v2: bool = False,
           started_ago: float | None = 5.0) -> GcsAnswer:
    return GcsAnswer(status, json.dumps(v1).encode() if v1 is not None else None, v2,
                     None if started_ago is None else AT - started_ago, AT)


@pytest.mark.parametrize("v2", [True, False])
def test_an_autoscaler_that_has_not_reported_yet_is_unknown_within_the_grace_and_none_after(v2):
    with pytest.raises(AutoscalingUnknown, match=rf"^Ray's GCS at gcs:6379: no {'v2 ' if v2 else ''}autoscaler has "
                                                 rf"reported yet, 5s after the cluster's head node started; one that "
                                                 rf"runs reports within {AUTOSCALER_GRACE_S:.0f}s of it$") as unknown:
        read_autoscaling(answer(reply([GPU]), v2=v2), GPU, "gcs:6379")
    assert unknown.value.pending   # said "is not known yet" (placement_waits.py), not "could not be asked"
    assert read_autoscaling(answer(reply([GPU]), v2=v2, started_ago=AUTOSCALER_GRACE_S + 1), GPU, "gcs:6379") == "none"


def test_what_an_autoscaler_reported_is_read_within_the_grace_too():
    assert read_autoscaling(answer(reply([GPU], "gpu-workers"), v2=True), GPU, "a") == "may_grow"
    assert read_autoscaling(answer(reply([GPU], "cpu-only", infeasible=[GPU]), v2=True), GPU, "a") == "infeasible"
    readonly = format_readonly_node_type(NODE)   # the read-only autoscaler of a cluster of `ray start` nodes
    assert read_autoscaling(answer(reply([GPU], readonly), v2=True), GPU, "a") == "none"
    v1 = {"autoscaler_report": {"node_type_mapping": {"10.0.0.1": "gpu-workers"}}}
    assert read_autoscaling(answer(reply([GPU]), v1=v1), GPU, "a") == "may_grow"
    v1 = {"autoscaler_report": {"node_type_mapping": {"10.0.0.1": format_readonly_node_type("10.0.0.1")}}}
    assert read_autoscaling(answer(reply([GPU]), v1=v1), GPU, "a") == "none"
    assert read_autoscaling(answer(reply([])), GPU, "a") == "placed"   # no longer pending: placed


def test_a_gcs_that_lists_no_head_node_start_is_read_as_after_the_grace():
    """No start time to count the grace from: read as before (a wait that never ends would be worse)."""
    assert read_autoscaling(answer(reply([GPU]), started_ago=None), GPU, "a") == "none"
