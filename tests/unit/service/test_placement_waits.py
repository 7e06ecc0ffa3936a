"""A trainer no live node can hold (tests/service/test_placement_waits.py has it on a real Ray cluster): after
PLACEMENT_WAIT_S unstarted its phase and its jobs' reason say what is missing and what to do, looked at again every
cluster_poll_s; it keeps waiting while the cluster may grow (a node joining by hand, or an autoscaler that may add
one), starts once a node that has it joins, and fails (its pending actor ended) only where the autoscaler says that
no node type it can start holds it."""

from __future__ import annotations

from dataclasses import replace

from actors.service.scheduler.cluster_plan import NodeInfo
from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.placement_waits import PLACEMENT_WAIT_S, AutoscalingUnknown, actor_resources
from tests.helpers.fleet_fakes import CLUSTER_POLL_S, HEAD, WORKER, FakeCluster, fleet_with
from tests.helpers.scheduler_fakes import status

GPU_NODE = NodeInfo(id="gpu00000dddd", address="10.0.0.4", cpus=8, gpus=1)
NO_GPU = "no node of the cluster has a GPU: device: cuda (or num_gpus) asks for one per trainer"


def _phase(fleet) -> str:
    return fleet.describe()[0]["phase"]


def test_a_trainer_asking_a_gpu_no_node_has_says_so_keeps_waiting_and_starts_once_one_joins(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_gpus=1))
    assert cluster.started[0].node is None   # no node has its resources: Ray is asked to place it anywhere
    clock.sleep(PLACEMENT_WAIT_S - 1)
    fleet.watch_all()
    assert _phase(fleet) == "starting its process" and cluster.asked == [] and fleet.why_none_runs() is None
    clock.sleep(1)
    fleet.watch_all()
    assert _phase(fleet).startswith(f"waiting for a node: {NO_GPU}; it starts once a node that has it joins; else "
                                    "add a node that has it (`ray start --address=<head>:6379` on such a machine), "
                                    "or ask for less: device: cpu or auto"), _phase(fleet)
    assert cluster.asked == [{"CPU": 1.0, "GPU": 1.0}]   # the actor's own request, as Ray's autoscaler lists it
    assert fleet.why_none_runs() == f"trainer trainer-0 {_phase(fleet)}"   # its jobs' reason
    # no autoscaler may add a node: what the service's wait_ready waits for is settled (only a node joined by hand
    # could place it), the trainer still waiting for one
    assert fleet.describe()[0]["unplaceable"] and fleet.all_settled() and not cluster.started[0].killed
    cluster.autoscaler = "may_grow"
    fleet.watch_all()
    assert len(cluster.asked) == 1   # looked at again only after cluster_poll_s
    clock.sleep(CLUSTER_POLL_S)
    fleet.watch_all()
    assert "the cluster's autoscaler may add such a node: waiting for it" in _phase(fleet)
    assert fleet.describe()[0]["error"] is None and not cluster.started[0].killed and not fleet.all_settled()
    assert not fleet.describe()[0]["unplaceable"]   # the autoscaler may add a node: waited for
    cluster.live = [HEAD, WORKER, GPU_NODE]   # a GPU node joins: the trainer is placed there
    clock.sleep(CLUSTER_POLL_S)
    fleet.follow_if_due()
    fleet.watch_all()
    assert cluster.current("trainer-0").node == GPU_NODE.id and _phase(fleet) == "starting its process"
    assert fleet.why_none_runs() is None


def test_a_demand_the_autoscaler_calls_infeasible_fails_the_trainer_and_its_jobs_say_why(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    cluster.autoscaler = "infeasible"
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_cpus=8))
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    trainer = fleet.describe()[0]
    assert trainer["phase"] == "failed" and cluster.started[0].killed and fleet.all_settled()
    assert trainer["error"].startswith("cannot be placed: no node of the cluster has 8 CPUs (num_cpus: 8; the most a "
                                       "node has: 4), and the cluster's autoscaler has no node type that has it; add "
                                       "a node"), trainer["error"]
    assert fleet.why_none_runs() == f"trainer trainer-0 {trainer['error']}"


def test_a_trainer_a_node_could_hold_is_left_to_wait_for_its_resources(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_cpus=4))
    clock.sleep(10 * PLACEMENT_WAIT_S)
    fleet.watch_all()
    assert _phase(fleet) == "starting its process" and cluster.asked == [] and fleet.why_none_runs() is None


def test_a_service_whose_trainers_no_node_can_hold_runs_none_and_its_jobs_say_why(tmp_path):
    """Trainers of a `nodes: each` kind asking a GPU on a cluster without one: none was started (each node lacks it),
    and its jobs waited queued with no reason; now their reason says what no node has, and the trainers start on a
    node that has it as it joins."""
    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="each", num_gpus=1))
    assert cluster.started == [] and fleet.describe() == []
    assert fleet.why_none_runs() == (f"no trainer runs: trainers[0] (smollm2-135m): {NO_GPU}; they start on each node "
                                     "that has it as it joins (`ray start --address=<head>:6379` on such a machine), "
                                     "or give the service's trainers less (num_gpus / num_cpus / "
                                     "memory_budget_bytes) and restart it")
    cluster.live = [HEAD, WORKER, GPU_NODE]
    clock.sleep(CLUSTER_POLL_S)
    fleet.follow_if_due()
    assert [t.node for t in cluster.started] == [GPU_NODE.id] and fleet.why_none_runs() is None


def test_a_trainer_ray_no_longer_lists_pending_is_not_said_to_wait(tmp_path):
    """Where Ray's GCS lists no pending demand of the trainer's shape (its actor was placed, e.g. a `pack` pipeline's
    stage 0 on a node of one GPU, and its process is still starting), nothing is said of its placement."""
    cluster = FakeCluster(HEAD, WORKER)
    cluster.autoscaler = "placed"
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_gpus=1))
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    assert cluster.asked and _phase(fleet) == "starting its process" and fleet.why_none_runs() is None


GIB = 2**30


def test_a_cpu_trainer_asks_ray_for_its_memory_budget_and_one_no_node_has_is_said_and_not_waited_for(tmp_path):
    """A CPU trainer's `memory_budget_bytes` asked nothing of Ray: one larger than any node's memory was placed
    anyway (or waited unsaid). Now its actor asks Ray for that much `memory` (as Ray's autoscaler lists the demand), it
    goes only to a node that has it, and where none has it its phase and its jobs' reason say so; with no autoscaler
    that may add a node, the service's wait_ready does not wait for it (`all_settled`)."""
    head, worker = replace(HEAD, memory_bytes=6 * GIB), replace(WORKER, memory_bytes=12 * GIB)
    fits = TrainerConfig(nodes="each", memory_budget_bytes=10 * GIB)
    cluster = FakeCluster(head, worker)
    fleet_with(tmp_path / "fits", cluster, kind=fits)
    assert [t.node for t in cluster.started] == [worker.id]   # the one node that has its budget
    cluster = FakeCluster(head, worker)
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", memory_budget_bytes=20 * GIB))
    assert cluster.started[0].node is None
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    assert cluster.asked == [{"CPU": 1.0, "memory": 20.0 * GIB}]
    assert _phase(fleet) == (
        "waiting for a node: no node of the cluster has 20.0 GiB of memory (memory_budget_bytes: 21474836480: a CPU "
        "trainer asks Ray for its budget as `memory`; the most a node has: 12.0 GiB); it starts once a node that has "
        "it joins; else add a node that has it (`ray start --address=<head>:6379` on such a machine), or ask for less: "
        "memory_budget_bytes of the service's trainers: kind (`aspen serve --config FILE`); left out, a CPU trainer "
        "plans for its share of half its node's RAM and asks Ray for no memory")
    assert fleet.describe()[0]["unplaceable"] and fleet.all_settled()
    # a GPU trainer's budget is the GPU's memory: it asks Ray for none of the host's
    assert actor_resources(TrainerConfig(num_gpus=1, memory_budget_bytes=20 * GIB)) == {"CPU": 1.0, "GPU": 1.0}


def test_jobs_of_a_base_whose_only_trainer_cannot_be_placed_say_so_while_another_base_runs(tmp_path):
    """Two kinds: one runs; the other asks a GPU no node has. Its base's jobs said "no trainer holds base model ...,
    start a trainer for it" (the policy's reason: its trainer is configured, it cannot be placed); now the reason the
    service gives for them is that trainer's."""
    cluster = FakeCluster(HEAD, WORKER)
    kinds = [TrainerConfig(nodes="any"), TrainerConfig(nodes="any", base_model="qwen2.5-0.5b", num_gpus=1)]
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=kinds)
    assert fleet.waits_by_base() == {}   # both are starting
    cluster.current("trainer-0").ready.give(status("trainer-0"))   # trainer-0 loads its model
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    phase = fleet.describe()[1]["phase"]
    assert fleet.describe()[0]["ready"] and phase.startswith(f"waiting for a node: {NO_GPU}") and fleet.all_settled()
    assert fleet.waits_by_base() == {(kinds[1].base_model, "none"): f"trainer trainer-1 {phase}"}
    assert fleet.why_none_runs() is None   # trainer-0 runs: its jobs are not told of trainer-1


def test_an_autoscaler_that_cannot_be_asked_is_not_taken_for_none_the_trainer_waits_and_it_is_asked_again(tmp_path):
    """What the cluster's autoscaler says could not be read (Ray's GCS failed or timed out: on a real cluster in
    tests/service/test_placement_waits.py): that was taken for "no autoscaler", so the service's wait for its trainers
    (`aspen run`'s, `aspen serve`'s) ended and gave up on a trainer an autoscaler might have been about to place. Now
    the trainer waits, its phase saying the check could not be made and why; the check is made again at the next look,
    and only an answer ends the wait."""
    cluster = FakeCluster(HEAD, WORKER)
    cluster.autoscaler = AutoscalingUnknown("Ray's GCS at 10.0.0.1:6379: RpcError: RPC error: Deadline Exceeded")
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any", num_gpus=1))
    clock.sleep(PLACEMENT_WAIT_S)
    fleet.watch_all()
    trainer = fleet.describe()[0]
    assert trainer["phase"].startswith(
        f"waiting for a node: {NO_GPU}; whether the cluster's autoscaler may add one could not be asked (Ray's GCS at "
        "10.0.0.1:6379: RpcError: RPC error: Deadline Exceeded): waiting, asked again at the next look "
        "(cluster_poll_s); else add a node that has it"), trainer["phase"]
    assert not trainer["unplaceable"] and not fleet.all_settled()   # unknown is not "no": waited for
    assert trainer["error"] is None and not cluster.started[0].killed
    assert fleet.why_none_runs() == f"trainer trainer-0 {trainer['phase']}"   # its jobs say it too
    clock.sleep(CLUSTER_POLL_S)
    fleet.watch_all()
    assert len(cluster.asked) == 2 and not fleet.all_settled()   # asked again; still unknown: still waited for
    cluster.autoscaler = "may_grow"   # it answers: one may add a node
    clock.sleep(CLUSTER_POLL_S)
    fleet.watch_all()
    assert "the cluster's autoscaler may add such a node: waiting for it" in _phase(fleet) and not fleet.all_settled()
    cluster.autoscaler = AutoscalingUnknown("Ray's GCS at 10.0.0.1:6379: RpcError: unavailable")
    clock.sleep(CLUSTER_POLL_S)
    fleet.watch_all()
    assert "could not be asked (Ray's GCS at 10.0.0.1:6379: RpcError: unavailable)" in _phase(fleet)
    cluster.autoscaler = "none"   # it answers: none runs; only a node joined by hand could place it
    clock.sleep(CLUSTER_POLL_S)
    fleet.watch_all()
    assert "it starts once a node that has it joins" in _phase(fleet)
    assert fleet.describe()[0]["unplaceable"] and fleet.all_settled() and len(cluster.asked) == 5


def test_a_kind_no_node_holds_beside_one_that_runs_is_said_and_its_base_jobs_say_why(tmp_path):
    """Two `nodes: each` kinds: one runs on every node, the other asks a GPU no node has, so it has no trainer at all.
    Nothing said so (the service's `trainers_error` only where it ran no trainer), and its base's jobs waited saying
    "no trainer holds base model ..., start a trainer for it" (the policy's reason). Now both say what no node has."""
    cluster = FakeCluster(HEAD, WORKER)
    kinds = [TrainerConfig(nodes="each"), TrainerConfig(nodes="each", base_model="qwen2.5-0.5b", num_gpus=1)]
    fleet, _, _, _, clock = fleet_with(tmp_path, cluster, kind=kinds)
    assert [t.node for t in cluster.started] == [HEAD.id, WORKER.id]   # kind 0 on each node, kind 1 on none
    said = (f"no trainer runs for trainers[1] (qwen2.5-0.5b): {NO_GPU}; they start on each node that has it as it "
            "joins (`ray start --address=<head>:6379` on such a machine), or give the service's trainers less "
            "(num_gpus / num_cpus / memory_budget_bytes) and restart it")
    assert fleet.unplanned() == said   # the service's trainers_error (`aspen serve` prints it)
    assert fleet.waits_by_base() == {("qwen2.5-0.5b", "none"): said}   # its base's jobs' reason
    assert fleet.why_none_runs() is None   # kind 0's trainers take jobs: theirs are not told of kind 1
    cluster.live = [HEAD, WORKER, GPU_NODE]   # a GPU node joins: both kinds run there
    clock.sleep(CLUSTER_POLL_S)
    fleet.follow_if_due()
    assert fleet.unplanned() is None and fleet.waits_by_base() == {}
    assert [(t.trainer_id, t.node) for t in cluster.started[2:]] == [("trainer-2", GPU_NODE.id),
                                                                     ("trainer-3", GPU_NODE.id)]


def test_a_service_with_no_trainer_says_so_in_its_trainers_error(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, _, _ = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="each", num_gpus=1))
    assert fleet.unplanned() == fleet.why_none_runs() and fleet.unplanned().startswith(
        f"no trainer runs: trainers[0] (smollm2-135m): {NO_GPU}")


WAIT_SETTINGS = """
import importlib, json, os
import actors.service.scheduler.placement_waits as waits
said = {}
for value in (None, "0.5", "soon", "0", "inf"):
    os.environ.pop("ASPEN_PLACEMENT_WAIT_S", None)
    if value is not None:
        os.environ["ASPEN_PLACEMENT_WAIT_S"] = value
    try:
        said[str(value)] = importlib.reload(waits).PLACEMENT_WAIT_S
    except ValueError as error:
        said[str(value)] = str(error)
print(json.dumps(said))
"""


def test_aspen_placement_wait_s_sets_the_wait_and_a_value_that_is_no_wait_is_refused_naming_it():
    """The wait a trainer Ray cannot place waits before it is looked at: 10 s unless ASPEN_PLACEMENT_WAIT_S says
    otherwise (the test session's 2 s: tests/conftest.py); a value that is not a number of seconds > 0 is refused as
    the module is imported, saying which variable and what to set (in a process of its own: this one's keeps its)."""
    import json
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", WAIT_SETTINGS], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr[-3000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    assert said["None"] == 10.0 and said["0.5"] == 0.5, said
    for value in ("soon", "0", "inf"):
        assert said[value] == (f"ASPEN_PLACEMENT_WAIT_S={value!r}: not a number of seconds > 0; set it to one (say "
                               "10, the default) or unset it"), said
