"""A trainer Ray can never place on the cluster (it asks a GPU, and no node of this machine's cluster has one): it
showed "starting its process" for ever and its jobs waited queued with no reason a user could act on. Now, within
the documented bound (PLACEMENT_WAIT_S unstarted, then the next look at the cluster's nodes, every cluster_poll_s),
the service's description of the trainer (what `aspen status`, the HTTP API and the console's trainer card show) and
its queued job's reason say that no node has a GPU and what to do; with no autoscaler it keeps waiting (a node that
has one may join). The reference is Ray itself: its GCS lists the trainer's GPU demand as pending, and none of its
nodes has a GPU."""

from __future__ import annotations

import time

import pytest

from actors.service.scheduler.placement_waits import PLACEMENT_WAIT_S
from orchestrator.client import Client
from tests.helpers.service import job_dict, service_config, wait_for, write_task_data

CLUSTER_POLL_S = 1.0


def _pending_demands() -> list[dict[str, float]]:
    """The resource requests Ray's GCS holds pending (as `ray status` lists its demands)."""
    import ray
    from ray._raylet import GcsClient
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply

    reply = GetClusterStatusReply()
    reply.ParseFromString(GcsClient(ray.get_runtime_context().gcs_address).get_cluster_status(timeout_s=30))
    pending = reply.cluster_resource_state.pending_resource_requests
    return [dict(demand.request.resources_bundle) for demand in pending]


def test_a_trainer_asking_a_gpu_no_node_has_says_so_and_its_jobs_say_why_they_wait(ray_session, tiny_model_dirs,
                                                                                   tmp_path):
    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], num_gpus=1)
    config = config.model_copy(update={"cluster_poll_s": CLUSTER_POLL_S})
    started = time.monotonic()
    client = Client.local(config, wait_ready=False)
    try:
        handle = client.submit(job_dict("waits", write_task_data(tmp_path / "data", "t"), 3),
                               base_model=str(tiny_model_dirs["llama"]))
        trainer = wait_for(lambda: next((t for t in client.info()["trainers"] if "no node" in t["phase"]), None),
                           timeout=PLACEMENT_WAIT_S + 60, what="the trainer's phase to say why it waits",
                           state=lambda: client.info()["trainers"])
        said_after = time.monotonic() - started
        # Ray's own view: the trainer's demand (a GPU) is pending, and no node has one
        assert {"CPU": 0.5, "GPU": 1.0} in _pending_demands()
        assert trainer["phase"].startswith("waiting for a node: no node of the cluster has a GPU: device: cuda (or "
                                           "num_gpus) asks for one per trainer; it starts once a node that has it "
                                           "joins; else add a node that has it (`ray start --address="), trainer
        assert not trainer["ready"] and trainer["error"] is None, trainer   # it keeps waiting: no autoscaler here
        # within the bound: PLACEMENT_WAIT_S, the next look at the nodes, and the service's own start on this busy
        # machine (the scheduler actor's process and its first tick)
        assert said_after < PLACEMENT_WAIT_S + 2 * CLUSTER_POLL_S + 30, said_after
        waits = "trainer trainer-0 waiting for a node"
        record = wait_for(lambda: (r := handle.status()).reason.startswith(waits) and r, timeout=30,
                          what="the job's reason", state=lambda: handle.status())
        assert record.state == "queued" and "no node of the cluster has a GPU" in record.reason, record
        time.sleep(3 * CLUSTER_POLL_S)   # still waiting, still saying why (not failed)
        assert client.info()["trainers"][0]["phase"] == trainer["phase"]
        # `aspen run` waits for its trainers before it submits: where they never start, its wait ends saying why
        with pytest.raises(Exception, match=r"trainers not ready after 2s: trainer-0: waiting for a node: no node of "
                                            r"the cluster has a GPU") as waited:
            client.wait_ready(timeout=2)
        assert "{" not in str(waited.value), waited.value   # the reason, not the trainers' description
    finally:
        client.shutdown()


def test_a_service_whose_gpu_trainers_no_node_can_hold_says_so_in_its_jobs_reason(ray_session, tiny_model_dirs,
                                                                                 tmp_path):
    """Trainers of a `nodes: each` kind asking a GPU: on this cluster, which has none (Ray's own resources say so),
    the service runs no trainer, and its job said nothing of why it waits; now its reason names what is missing."""
    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    base = tiny_model_dirs["llama"]
    config = service_config(tmp_path / "state", base, num_gpus=1, nodes="each")
    client = Client.local(config, wait_ready=False)
    try:
        assert client.info()["trainers"] == []
        handle = client.submit(job_dict("waits", write_task_data(tmp_path / "data", "t"), 3), base_model=str(base))
        record = wait_for(lambda: (r := handle.status()).reason.startswith("no trainer runs") and r, timeout=60,
                          what="the job's reason", state=lambda: handle.status())
        assert record.state == "queued" and record.reason.startswith(
            f"no trainer runs: trainers[0] ({base}): no node of the cluster has a GPU: device: cuda (or num_gpus) asks "
            "for one per trainer; they start on each node that has it as it joins"), record.reason
    finally:
        client.shutdown()
