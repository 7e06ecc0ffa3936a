"""A trainer Ray can never place on the cluster (it asks a GPU, and no node of this machine's cluster has one): it
showed "starting its process" for ever and its jobs waited queued with no reason a user could act on. Now, within
the documented bound (PLACEMENT_WAIT_S unstarted, then the next look at the cluster's nodes, every cluster_poll_s),
the service's description of the trainer (what `aspen status`, the HTTP API and the console's trainer card show) and
its queued job's reason say that no node has a GPU and what to do; with no autoscaler it keeps waiting (a node that
has one may join). The reference is Ray itself: its GCS lists the trainer's GPU demand as pending, and none of its
nodes has a GPU."""

from __future__ import annotations

import json
import threading
import time

import pytest

from actors.ray_trainers import AUTOSCALER_GRACE_S
from actors.service.scheduler.placement_waits import PLACEMENT_WAIT_S
from orchestrator.client import Client
from orchestrator.errors import ServiceError
from tests.helpers.service import job_dict, service_config, wait_for, write_task_data

CLUSTER_POLL_S = 1.0


def look_until(fleet, clock, settled, timeout: float) -> bool:
    """The fleet's looks, one a cluster poll (its fake clock moved on, real time passing as the GCS is asked from
    its own thread), until `settled()`; it, or failure after `timeout` real seconds."""
    from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S

    def look() -> bool:
        clock.sleep(FLEET_POLL_S)
        fleet.watch_all()
        return settled()

    return wait_for(look, timeout=timeout, every=0.5, what="the fleet's wait to settle",
                    state=lambda: fleet.describe())


class SchedulerTicks:
    """A thread ticking as SchedulerLoop does: each tick under the service's lock (`lock`), the fleet's `look` every
    cluster poll of its fake `clock`; `times` holds each tick's clock reading."""

    def __init__(self, clock, look):
        from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S

        self.poll_s, self.clock, self.look = FLEET_POLL_S, clock, look
        self.lock, self.stop, self.times = threading.RLock(), threading.Event(), []
        self.thread = threading.Thread(target=self.tick, daemon=True)

    def tick(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                self.clock.sleep(self.poll_s)
                self.look()
                self.times.append(self.clock())
            time.sleep(0.1)

    def lock_waits(self, read, seconds: float) -> list[float]:
        """How long each `read()` under the lock (what `status`, the HTTP API take to read the job table) waited to
        take it, one read every 0.2 s for `seconds`."""
        waits = []
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            asked = time.monotonic()
            with self.lock:
                read()
            waits.append(time.monotonic() - asked)
            time.sleep(0.2)
        return waits

    def end(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)


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
        settled = "it starts once a node that has it joins"   # the GCS answered: no autoscaler (after its grace)
        trainer = wait_for(lambda: next((t for t in client.info()["trainers"] if settled in t["phase"]), None),
                           timeout=PLACEMENT_WAIT_S + AUTOSCALER_GRACE_S + 60,
                           what="the trainer's phase to say why it waits", state=lambda: client.info()["trainers"])
        said_after = time.monotonic() - started
        # Ray's own view: the trainer's demand (a GPU) is pending, and no node has one
        assert {"CPU": 0.5, "GPU": 1.0} in _pending_demands()
        assert trainer["phase"].startswith("waiting for a node: no node of the cluster has a GPU: device: cuda (or "
                                           "num_gpus) asks for one per trainer; it starts once a node that has it "
                                           "joins; else add a node that has it (`ray start --address="), trainer
        assert not trainer["ready"] and trainer["error"] is None, trainer   # it keeps waiting: no autoscaler here
        # within the bound: PLACEMENT_WAIT_S, the next look at the nodes, and the service's own start on this busy
        # machine (the scheduler actor's process and its first tick); on a cluster started less than
        # AUTOSCALER_GRACE_S before (this session's, where this test runs first), the grace's end
        assert said_after < PLACEMENT_WAIT_S + AUTOSCALER_GRACE_S + 2 * CLUSTER_POLL_S + 30, said_after
        waits = "trainer trainer-0 waiting for a node"
        record = wait_for(lambda: (r := handle.status()).reason.startswith(waits) and r, timeout=30,
                          what="the job's reason", state=lambda: handle.status())
        assert record.state == "queued" and "no node of the cluster has a GPU" in record.reason, record
        time.sleep(3 * CLUSTER_POLL_S)   # still waiting, still saying why (not failed)
        assert client.info()["trainers"][0]["phase"] == trainer["phase"]
        # `aspen run` waits for its trainers before it submits: with no autoscaler that may add a node, its wait (600 s
        # by default) ends at once, saying why
        began = time.monotonic()
        with pytest.raises(ServiceError, match=r"^no trainer could start: trainer-0: waiting for a node: no node of "
                                               r"the cluster has a GPU") as waited:
            client.wait_ready()
        assert time.monotonic() - began < 10 and "{" not in str(waited.value), waited.value   # the reason only
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
    try:   # once the service's first read of the cluster's nodes answered (off its lock: it says so until then)
        info = wait_for(lambda: (said := client.info()).get("nodes") is None and said, timeout=30,
                        what="the first read of the nodes", state=lambda: client.info())
        assert info["trainers"] == []
        # said where the service is described (`aspen serve` lists its *_error keys, GET /v1/service has it)
        assert info["trainers_error"].startswith(f"no trainer runs: trainers[0] ({base}): no node of the cluster has "
                                                 "a GPU"), info
        # what `aspen run` waits in ends saying why, as where a `nodes: any` trainer waits for a node (it returned as
        # though the trainers were ready); `aspen serve`'s (nodes_may_join: the service stays up) returns the info
        with pytest.raises(ServiceError, match=r"^no trainer could start: no trainer runs: trainers\[0\] "):
            client.wait_ready()
        assert client.wait_ready(nodes_may_join=True)["trainers_error"] == info["trainers_error"]
        handle = client.submit(job_dict("waits", write_task_data(tmp_path / "data", "t"), 3), base_model=str(base))
        record = wait_for(lambda: (r := handle.status()).reason.startswith("no trainer runs") and r, timeout=60,
                          what="the job's reason", state=lambda: handle.status())
        assert record.state == "queued" and record.reason.startswith(
            f"no trainer runs: trainers[0] ({base}): no node of the cluster has a GPU: device: cuda (or num_gpus) asks "
            "for one per trainer; they start on each node that has it as it joins"), record.reason
    finally:
        client.shutdown()


GIB = 2**30


def test_a_cpu_trainer_whose_memory_budget_no_node_has_ends_the_wait_for_trainers_saying_so(ray_session,
                                                                                            tiny_model_dirs, tmp_path):
    """A CPU trainer's `memory_budget_bytes` asked Ray for nothing: one larger than any node's memory started anyway
    and planned steps for memory its node has not. Now its actor asks Ray for that much `memory`: where no node has
    it (Ray's own node resources are the reference) Ray keeps it pending, and the wait for the trainers (`aspen serve`'s
    and `aspen run`'s, 600 s by default) ends within the documented bound (PLACEMENT_WAIT_S, then the next look at the
    nodes), saying what the trainer asks, what the nodes have and what to change. One whose budget a node has is
    placed there, holding its budget of the node's `memory` while it runs."""
    import ray

    most = max(node["Resources"].get("memory", 0) for node in ray.nodes() if node["Alive"])
    budget = (int(most) // GIB + 2) * GIB   # whole GiB: above every node's memory
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], memory_budget_bytes=budget)
    started = time.monotonic()
    client = Client.local(config.model_copy(update={"cluster_poll_s": CLUSTER_POLL_S}), wait_ready=False)
    try:
        with pytest.raises(ServiceError) as ended:
            client.wait_ready()
        took = time.monotonic() - started
        assert {"CPU": 0.5, "memory": float(budget)} in _pending_demands()   # Ray holds the trainer's ask pending
        assert str(ended.value).startswith(
            f"no trainer could start: trainer-0: waiting for a node: no node of the cluster has {budget / GIB:.1f} GiB "
            f"of memory (memory_budget_bytes: {budget}: a CPU trainer asks Ray for its budget as `memory`; the most a "
            f"node has: {most / GIB:.1f} GiB); it starts once a node that has it joins; else add a node that has it "
            "(`ray start --address=<head>:6379` on such a machine), or ask for less: memory_budget_bytes of the "
            "service's trainers: kind (`aspen serve --config FILE`)"), ended.value
        assert took < PLACEMENT_WAIT_S + 2 * CLUSTER_POLL_S + 30, took   # the service's own start on a busy machine
    finally:
        client.shutdown()
    fits = service_config(tmp_path / "fits", tiny_model_dirs["llama"], memory_budget_bytes=2 * GIB)
    before = ray.available_resources().get("memory", 0)
    client = Client.local(fits)   # waits until its trainer is ready
    try:
        assert [t["memory_budget_bytes"] for t in client.info()["trainers"]] == [2 * GIB]
        assert before - ray.available_resources().get("memory", 0) == pytest.approx(2 * GIB, abs=1)
    finally:
        client.shutdown()


def test_aspen_run_on_a_cluster_of_ray_address_whose_trainer_no_node_holds_ends_saying_why(ray_session,
                                                                                          tiny_model_dirs, tmp_path):
    """`aspen run` with RAY_ADDRESS of a cluster without a GPU, its jobs file asking `device: cuda`: it printed the
    trainer's wait and then waited 600 s before it stopped. Now it ends within the bound (its service's start, then
    PLACEMENT_WAIT_S and the next look at the nodes) with exit status 1 and one line saying why and what to do."""
    import os
    import subprocess
    import sys

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    data = write_task_data(tmp_path / "data", "t")
    (tmp_path / "jobs.yaml").write_text(json.dumps({"base_model": str(tiny_model_dirs["llama"]), "output_dir": "out",
                                                    "device": "cuda", "step_tokens": 512,
                                                    "jobs": [job_dict("waits", data, 3)]}))
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "orchestrator.cli", "run", "jobs.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    took = time.monotonic() - began
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if line.startswith("aspen: ")]
    assert len(said) == 1 and said[0].startswith(
        "aspen: no trainer could start: trainer-0: waiting for a node: no node of the cluster has a GPU: device: cuda "
        "(or num_gpus) asks for one per trainer; it starts once a node that has it joins; else add a node that has it "
        "(`ray start --address=<head>:6379` on such a machine), or ask for less: device: cpu or auto in a jobs file"), \
        run.stderr[-3000:]
    # the process's imports and its service's start, PLACEMENT_WAIT_S, the next look (cluster_poll_s: 2 s)
    assert took < PLACEMENT_WAIT_S + 2 + 60, took


def test_a_trainer_no_node_holds_beside_a_ready_one_does_not_hold_up_the_service_and_its_jobs_say_why(
        ray_session, tiny_model_dirs, tmp_path):
    """Two trainers: one on this cluster's CPUs, one asking a GPU, which no node has (Ray's own resources say so).
    Waiting for the service's trainers ended only after its 600 s, and the second base's job then waited saying that
    no trainer holds its base and to start one. Now the wait ends once the first is ready and the second is said, and
    that job's reason is the second trainer's: what no node has and what to do."""
    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    llama, qwen = str(tiny_model_dirs["llama"]), str(tiny_model_dirs["qwen2"])
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"])
    gpu = config.trainers[0].model_copy(update={"base_model": qwen, "num_gpus": 1})
    config = config.model_copy(update={"cluster_poll_s": CLUSTER_POLL_S, "trainers": [*config.trainers, gpu]})
    started = time.monotonic()
    client = Client.local(config)   # waits for its trainers: the GPU one is not waited for
    try:
        took = time.monotonic() - started
        trainers = {t["id"]: t for t in client.info()["trainers"]}
        assert trainers["trainer-0"]["ready"] and trainers["trainer-0"]["base_model"] == llama, trainers
        assert trainers["trainer-1"]["unplaceable"] and not trainers["trainer-1"]["ready"], trainers
        assert {"CPU": 0.5, "GPU": 1.0} in _pending_demands()   # Ray holds the GPU trainer pending
        assert took < 300, took   # well within the wait's 600 s: trainer-0's load, then PLACEMENT_WAIT_S at most
        data = write_task_data(tmp_path / "data", "t")
        waits = client.submit(job_dict("waits", data, 3), base_model=qwen)
        runs = client.submit(job_dict("runs", data, 3), base_model=llama)
        record = wait_for(lambda: (r := waits.status()).reason.startswith("trainer trainer-1 waiting") and r,
                          timeout=60, what="the job's reason", state=lambda: waits.status())
        assert record.state == "queued" and record.reason.startswith(
            "trainer trainer-1 waiting for a node: no node of the cluster has a GPU: device: cuda (or num_gpus) asks "
            "for one per trainer"), record.reason
        assert runs.wait(timeout=240).state == "completed"   # the ready trainer goes on
        assert waits.status().reason == record.reason
    finally:
        client.shutdown()


def test_a_trainer_whose_autoscaler_ray_cannot_be_asked_of_is_waited_for_until_ray_answers(ray_session, tmp_path,
                                                                                          monkeypatch):
    """The fleet over real trainer actors on this cluster (`RayTrainers`, as the scheduler actor runs it), one asking a
    GPU no node has. Where the GCS call that says what the cluster's autoscaler knows failed or timed out, the answer
    was taken for "no autoscaler": the trainer was called unplaceable and the service's wait for it (`aspen run`'s,
    `aspen serve`'s: `all_settled`) ended, giving up on a trainer an autoscaler might have been about to place. Here
    that call (Ray's GCS client, made to this cluster's GCS) times out: the trainer keeps waiting,
    its phase saying the check could not be made and why, and is asked of again at the next look; once the GCS
    answers, its answer (this cluster runs no autoscaler: Ray's own reply is the reference) settles the wait."""
    import uuid

    import ray._raylet
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply
    from ray.exceptions import RpcError

    from actors.ray_trainers import RayTrainers
    from actors.service.scheduler.config import StorageConfig, TrainerConfig
    from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S
    from tests.helpers.fleet_fakes import fleet_with

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    real = ray._raylet.GcsClient
    timeouts = []

    class TimesOut(real):   # Ray's GCS client, connected to this cluster's GCS, whose one call times out
        def get_cluster_status(self, timeout_s=None):
            timeouts.append(timeout_s)
            raise RpcError("RPC error: Deadline Exceeded")   # as Ray's client says a deadline passed

    def real_demands() -> list[dict[str, float]]:
        with monkeypatch.context() as answering:
            answering.setattr(ray._raylet, "GcsClient", real)
            return _pending_demands()

    monkeypatch.setattr(ray._raylet, "GcsClient", TimesOut)
    trainers = RayTrainers(f"gcs{uuid.uuid4().hex[:6]}", str(tmp_path / "state"), "fifo", StorageConfig())
    fleet, _, _, _, clock = fleet_with(tmp_path, trainers, kind=TrainerConfig(nodes="any", num_gpus=1, num_cpus=0.5))
    try:
        demand = {"CPU": 0.5, "GPU": 1.0}   # as Ray lists the trainer's: pending (as PLACEMENT_WAIT_S lets it be)
        wait_for(lambda: demand in real_demands(), timeout=60, what="Ray to list the trainer's demand pending")
        clock.sleep(PLACEMENT_WAIT_S)
        fleet.watch_all()   # the first look asks the GCS from the asking thread: no answer yet, waited for
        assert "may add one is not known yet (Ray's GCS at " in fleet.describe()[0]["phase"], fleet.describe()
        assert ": asked, no answer yet): waiting" in fleet.describe()[0]["phase"] and not fleet.all_settled()
        wait_for(lambda: timeouts, timeout=30, what="the GCS to be asked")
        assert timeouts == [10]   # asked, as the service asks (a 10 s deadline), and timed out
        wait_for(lambda: not trainers.gcs.asking, timeout=30, what="the ask to end")
        clock.sleep(FLEET_POLL_S)
        fleet.watch_all()
        trainer = fleet.describe()[0]
        assert trainer["phase"].startswith(
            "waiting for a node: no node of the cluster has a GPU: device: cuda (or num_gpus) asks for one per "
            f"trainer; whether the cluster's autoscaler may add one could not be asked (Ray's GCS at "
            f"{ray_session.get_runtime_context().gcs_address}: RpcError: RPC error: Deadline Exceeded): waiting, asked "
            "again at the next look (cluster_poll_s); else add a node that has it"), trainer
        assert not trainer["unplaceable"] and trainer["error"] is None and not fleet.all_settled(), trainer
        wait_for(lambda: len(timeouts) == 2, timeout=30, what="the GCS to be asked again")   # at that look
        wait_for(lambda: not trainers.gcs.asking, timeout=30, what="the ask to end")
        clock.sleep(FLEET_POLL_S)
        fleet.watch_all()
        assert not fleet.all_settled()   # unknown still: still waited for
        monkeypatch.undo()   # the GCS answers again
        reply = GetClusterStatusReply()   # Ray's own answer: the trainer's demand pending, no autoscaler reporting
        reply.ParseFromString(real(ray_session.get_runtime_context().gcs_address).get_cluster_status(timeout_s=30))
        assert not reply.HasField("autoscaling_state") and demand in _pending_demands()
        settled = look_until(fleet, clock, fleet.all_settled, AUTOSCALER_GRACE_S + 60)   # once the grace has passed
        trainer = fleet.describe()[0]
        assert "; it starts once a node that has it joins; else add a node" in trainer["phase"], trainer
        assert trainer["unplaceable"] and settled   # the answer ends the wait: only a node joined by hand
    finally:
        fleet.kill_all()


def test_aspen_serve_of_a_kind_no_node_holds_beside_one_that_runs_says_why_and_so_do_its_jobs(ray_session,
                                                                                             tiny_model_dirs, tmp_path):
    """`aspen serve` of two `nodes: each` kinds on this cluster: one on its CPUs, one asking a GPU, which no node has
    (Ray's own resources say so), so that kind has no trainer at all. `aspen serve` listed the running trainer and
    nothing of the other kind, and the jobs of its base waited saying "no trainer holds base model ..., start a
    trainer for it". Now what it prints says what no node has and what to do, and so does those jobs' reason."""
    import os
    import subprocess
    import sys

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    llama, qwen = str(tiny_model_dirs["llama"]), str(tiny_model_dirs["qwen2"])
    trainer = {"step_tokens": 512, "num_cpus": 0.5, "threads": 1, "nodes": "each", "count": 1}
    (tmp_path / "service.yaml").write_text(json.dumps({
        "state_dir": str(tmp_path / "state"), "cluster_poll_s": CLUSTER_POLL_S, "tick_seconds": 0.1,
        "trainers": [{**trainer, "base_model": llama}, {**trainer, "base_model": qwen, "num_gpus": 1}]}))
    address = ray_session.get_runtime_context().gcs_address
    said = (f"no trainer runs for trainers[1] ({qwen}): no node of the cluster has a GPU: device: cuda (or num_gpus) "
            "asks for one per trainer; they start on each node that has it as it joins (`ray start "
            "--address=<head>:6379` on such a machine), or give the service's trainers less (num_gpus / num_cpus / "
            "memory_budget_bytes) and restart it")
    try:
        served = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--config", "service.yaml",
                                 "--address", address, "--insecure"], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300, env={**os.environ, "RAY_ADDRESS": address})
        assert served.returncode == 0, served.stderr[-3000:]
        assert "aspen service running" in served.stdout and f"  trainers error: {said}" in served.stdout.splitlines(), \
            served.stdout
        client = Client.connect(address)
        trainers = client.info()["trainers"]
        assert [(t["base_model"], t["ready"]) for t in trainers] == [(llama, True)], trainers
        waits = client.submit(job_dict("waits", write_task_data(tmp_path / "data", "t"), 3), base_model=qwen)
        record = wait_for(lambda: (r := waits.status()).reason.startswith("no trainer runs for") and r, timeout=60,
                          what="the job's reason", state=lambda: waits.status())
        assert record.state == "queued" and record.reason == said, record.reason
    finally:
        try:
            Client.connect(address).shutdown()
        except ServiceError:
            pass   # it did not start


def test_a_gcs_that_does_not_answer_holds_neither_the_scheduler_tick_nor_the_service_lock(ray_session, tmp_path,
                                                                                         monkeypatch):
    """The fleet over real trainer actors on this cluster (`RayTrainers`, as the scheduler actor runs it), two asking
    GPUs no node has, its looks made by a ticking thread under a lock as the scheduler's loop makes them (under the
    service's lock, which `status`, `submit`, the HTTP API and the console wait on). The GCS call that says what the
    cluster's autoscaler knows was made in the tick: a GCS that did not answer held the tick and the lock for its
    10 s deadline at each look, per trainer. Here that call (Ray's GCS client, to this cluster's GCS) hangs: the lock
    is taken within a small bound throughout, one call is in flight for both trainers, their wait goes on (unknown),
    and once the GCS answers (no autoscaler on this cluster: Ray's own reply is the reference) the wait ends."""
    import uuid

    import ray._raylet
    from ray.core.generated.autoscaler_pb2 import GetClusterStatusReply
    from ray.exceptions import RpcError

    import actors.ray_trainers
    from actors.ray_trainers import RayTrainers
    from actors.service.scheduler.config import StorageConfig, TrainerConfig
    from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S
    from tests.helpers.fleet_fakes import fleet_with

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    real = ray._raylet.GcsClient
    address = ray_session.get_runtime_context().gcs_address
    answer, calls, flying, peak = threading.Event(), [], [], [0]
    deadline = 3.0   # Ray's deadline for each GCS call (GCS_TIMEOUT_S, 10 s), shortened where RayTrainers runs: here
    monkeypatch.setattr(actors.ray_trainers, "GCS_TIMEOUT_S", deadline)

    class Hangs(real):   # Ray's GCS client, connected to this cluster's GCS, whose call waits until told to answer
        def get_cluster_status(self, timeout_s=None):
            calls.append(timeout_s)
            flying.append(timeout_s)
            peak[0] = max(peak[0], len(flying))
            try:
                if not answer.wait(timeout_s):   # no later than Ray's own deadline for it, then as Ray says it
                    raise RpcError("RPC error: Deadline Exceeded")
                return real(address).get_cluster_status(timeout_s=timeout_s)
            finally:
                flying.pop()

    trainers = RayTrainers(f"hang{uuid.uuid4().hex[:6]}", str(tmp_path / "state"), "fifo", StorageConfig(),
                           cluster_poll_s=FLEET_POLL_S)
    gpu = TrainerConfig(nodes="any", num_gpus=1, num_cpus=0.5)
    fleet, _, table, _, clock = fleet_with(tmp_path, trainers, kind=[gpu, gpu.model_copy(update={"num_gpus": 2})])
    ticking = SchedulerTicks(clock, fleet.watch_all)
    lock, ticks = ticking.lock, ticking.times
    try:
        demands = [{"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.5, "GPU": 2.0}]   # as Ray lists them: pending
        wait_for(lambda: all(d in _pending_demands() for d in demands), timeout=60, what="Ray to list the demands")
        clock.sleep(PLACEMENT_WAIT_S)
        monkeypatch.setattr(ray._raylet, "GcsClient", Hangs)
        ticking.thread.start()
        waits = ticking.lock_waits(table.all, deadline + 1)   # the GCS hangs for longer than its deadline
        assert max(waits) < 1.5, max(waits)   # on this busy machine; it was the deadline per trainer
        # one call in flight at most, for both trainers (the next asked once one timed out), at Ray's deadline
        assert calls in ([deadline], [deadline, deadline]) and peak == [1], (calls, peak)
        assert len(ticks) > 5, len(ticks)   # the tick went on
        with lock:
            phases = [t["phase"] for t in fleet.describe()]
            settled = fleet.all_settled()
        assert all("whether the cluster's autoscaler may add one is not known yet (Ray's GCS at " in p or
                   "could not be asked (Ray's GCS at " in p for p in phases), phases   # (once its call timed out)
        assert not settled
        answer.set()   # the GCS answers: Ray's own reply lists both demands pending, and no autoscaler reporting
        reply = GetClusterStatusReply()
        reply.ParseFromString(real(ray_session.get_runtime_context().gcs_address).get_cluster_status(timeout_s=30))
        assert not reply.HasField("autoscaling_state")
        def settled() -> bool:
            with lock:
                return fleet.all_settled()

        wait_for(settled, timeout=AUTOSCALER_GRACE_S + 60, what="the wait to end", state=lambda: fleet.describe())
        with lock:
            assert all("it starts once a node that has it joins" in t["phase"] for t in fleet.describe())
    finally:
        ticking.end()
        fleet.kill_all()


def test_aspen_serve_whose_trainers_no_node_holds_exits_0_saying_so_whether_nodes_any_or_each(ray_session,
                                                                                           tiny_model_dirs, tmp_path):
    """`aspen serve` on this cluster (no GPU: Ray's own resources say so) of one kind asking a GPU. As `nodes: each`
    it exited 0 (the service running, `trainers error` said: it starts on a node that joins); as `nodes: any` it
    exited 1 ("no trainer could start"), while the service it started kept running and would start that trainer once
    a node that has a GPU joined, as the other's. Now both exit 0, the service running, saying what no node has and
    what to do (docs/cluster.md); Ray holds the `nodes: any` trainer's demand pending."""
    import os
    import subprocess
    import sys

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    base = str(tiny_model_dirs["llama"])
    address = ray_session.get_runtime_context().gcs_address
    said = {"any": (f"  trainer-0: {base} ", "  NOT PLACED: waiting for a node: no node of the cluster has a GPU: "),
            "each": (f"  trainers error: no trainer runs: trainers[0] ({base}): no node of the cluster has a GPU: ",
                     "; they start on each node that has it as it joins")}
    for nodes in ("any", "each"):
        folder = tmp_path / nodes
        folder.mkdir()
        (folder / "service.yaml").write_text(json.dumps({
            "state_dir": str(folder / "state"), "cluster_poll_s": CLUSTER_POLL_S, "tick_seconds": 0.1,
            "trainers": [{"step_tokens": 512, "num_cpus": 0.5, "threads": 1, "nodes": nodes, "count": 1,
                          "num_gpus": 1, "base_model": base}]}))
        try:
            served = subprocess.run([sys.executable, "-m", "orchestrator.cli", "serve", "--config", "service.yaml",
                                     "--address", address, "--insecure"], cwd=folder, capture_output=True, text=True,
                                    timeout=300, env={**os.environ, "RAY_ADDRESS": address})
            assert served.returncode == 0 and "Traceback" not in served.stderr, (nodes, served.stderr[-3000:])
            lines = served.stdout.splitlines()
            assert "aspen service running" in served.stdout and any(
                line.startswith(said[nodes][0]) and said[nodes][1] in line for line in lines), (nodes, served.stdout)
            info = Client.connect(address).info()   # still running
            if nodes == "any":
                assert {"CPU": 0.5, "GPU": 1.0} in _pending_demands()   # Ray holds the trainer's ask pending
                assert [t["unplaceable"] for t in info["trainers"]] == [True], info
            else:
                assert info["trainers"] == [] and info["trainers_error"], info
        finally:
            try:
                Client.connect(address).shutdown()
            except ServiceError:
                pass   # it did not start



OWN_CLUSTER_RUN = """
import json, sys, time
from ray._raylet import GcsClient
import ray
from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
from ray.experimental.internal_kv import _internal_kv_del
from orchestrator.client import Client
from orchestrator.errors import ServiceError
from orchestrator.ray_cluster import ensure_ray
from tests.helpers.service import service_config
import psutil

ensure_ray()   # the private cluster Client.local starts without an address
# Ray's autoscaler monitor, stopped at once, may or may not have written its first status by then (a race; where it
# has, that status already read as "none runs"): the test takes the outcome where it had not
_internal_kv_del(DEBUG_AUTOSCALING_STATUS)

budget = (psutil.virtual_memory().total // 2**30 + 2) * 2**30   # whole GiB: above this machine's memory
config = service_config(sys.argv[1], sys.argv[2], memory_budget_bytes=budget)
client = Client.local(config.model_copy(update={"cluster_poll_s": 1.0}), wait_ready=False)
try:
    client.wait_ready()
    said = None
except ServiceError as error:
    said = str(error)
ended = time.time()
nodes = GcsClient(ray.get_runtime_context().gcs_address).get_all_node_info(timeout=30).values()
head = max(node.start_time_ms / 1000 for node in nodes if node.is_head_node)
client.shutdown()
print(json.dumps({"said": said, "after_head": ended - head, "budget": budget}))
"""


def test_a_private_cluster_whose_trainer_no_node_holds_ends_the_wait_without_the_autoscaler_grace(
        tiny_model_dirs, tmp_path):
    """`Client.local` without an address (what `aspen run`, `aspen sweep FILE` and `aspen demo` use) starts a private
    cluster and stops its autoscaler monitor: where the monitor had not written its first status by then (a race), no
    autoscaler ever reports to its GCS, and a trainer no node holds (a CPU trainer whose memory_budget_bytes is above
    the machine's memory) waited AUTOSCALER_GRACE_S ("no autoscaler has reported yet") from the cluster's start, so
    the wait for the trainers ended >= 30 s after it. The cluster now says
    in its GCS that no autoscaler runs there: the wait ends within the old bound (the service's start,
    PLACEMENT_WAIT_S, the next look), saying why. The reference is the head node's start as Ray's GCS lists it."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", OWN_CLUSTER_RUN, str(tmp_path / "state"),
                          str(tiny_model_dirs["llama"])], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert (result["said"] or "").startswith(
        f"no trainer could start: trainer-0: waiting for a node: no node of the cluster has "
        f"{result['budget'] / GIB:.1f} GiB of memory"), result
    assert "no autoscaler has reported yet" not in run.stderr, run.stderr[-3000:]
    # without the grace: the service's start, PLACEMENT_WAIT_S, the next look; with it, 30 s or more
    assert result["after_head"] < AUTOSCALER_GRACE_S, result


def test_a_slow_node_read_holds_neither_the_fleet_look_nor_the_service_lock(ray_session, tmp_path, monkeypatch):
    """The fleet's look at the live nodes (every cluster_poll_s, under the service's lock, which `status`, `submit`,
    the HTTP API and the console wait on) called `ray.nodes()`, a call to Ray's GCS, in the tick: a GCS slow to
    answer held the lock as long. Here that call (Ray's own, to this cluster's GCS) hangs for 3 s: the lock is taken
    within a small bound throughout, one read is in flight at a time, and once the GCS answers, the fleet's nodes are
    Ray's (`ray.nodes()`, the reference) within two looks."""
    import uuid

    import ray

    from actors.ray_trainers import RayTrainers
    from actors.service.scheduler.config import StorageConfig, TrainerConfig
    from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S
    from tests.helpers.fleet_fakes import fleet_with

    real = ray.nodes
    answer, calls, flying, peak = threading.Event(), [], [], [0]

    def hangs():   # Ray's own read of this cluster's nodes, which waits until told to answer
        calls.append(time.monotonic())
        flying.append(1)
        peak[0] = max(peak[0], len(flying))
        try:
            answer.wait(30)
            return real()
        finally:
            flying.pop()

    trainers = RayTrainers(f"nodes{uuid.uuid4().hex[:6]}", str(tmp_path / "state"), "fifo", StorageConfig(),
                           cluster_poll_s=FLEET_POLL_S)
    # a kind no node holds (`nodes: each`, a GPU): no trainer is started, the fleet only looks at the nodes
    fleet, _, table, _, clock = fleet_with(tmp_path, trainers, kind=TrainerConfig(nodes="each", num_gpus=1))
    ticking = SchedulerTicks(clock, fleet.follow_if_due)
    looks = ticking.times
    monkeypatch.setattr(ray, "nodes", hangs)
    ticking.thread.start()
    try:
        waits = ticking.lock_waits(table.all, 3)   # twice the bound below: the old hang held the lock as long
        assert max(waits) < 1.5, max(waits)   # on this busy machine; it was the GCS's whole hang
        assert len(calls) == 1 and peak == [1], (calls, peak)   # one read in flight, the looks going on
        assert len(looks) > 5, len(looks)
        answer.set()
        expected = sorted(node["NodeID"] for node in real() if node["Alive"])
        wait_for(lambda: sorted(fleet.nodes) == expected and len(calls) >= 2, timeout=30,
                 what="the fleet to see Ray's nodes")
    finally:
        answer.set()
        ticking.end()



def test_a_gcs_that_hangs_on_the_first_node_read_stalls_no_status_and_then_plans_as_a_read_in_the_call(
        ray_session, tmp_path, monkeypatch):
    """The fleet's first read of the live nodes was made in the call (NodeReader had no answer yet), under the
    service's lock: on a cluster whose GCS was slow, the first `status` waited on it. Here Ray's own read of this
    cluster's nodes hangs from the first call: the lock is taken within a small bound, the fleet says it is reading
    the cluster's nodes (not that no node fits, nor that its wait for trainers is over), and once the GCS answers,
    it plans as a fleet that read Ray's nodes in the call does (the reference: the same kinds over `ray.nodes()`)."""
    import uuid

    import ray

    from actors.ray_trainers import RayTrainers, alive_nodes
    from actors.service.scheduler.config import StorageConfig, TrainerConfig
    from actors.service.scheduler.trainer_fleet import READING_NODES, TrainerFleet
    from tests.helpers.fleet_fakes import CLUSTER_POLL_S as FLEET_POLL_S
    from tests.helpers.fleet_fakes import fleet_with

    real = ray.nodes
    answer, calls = threading.Event(), []

    def hangs():   # Ray's own read of this cluster's nodes, which waits until told to answer
        calls.append(time.monotonic())
        answer.wait(30)
        return real()

    kinds = [TrainerConfig(nodes="each", num_gpus=1), TrainerConfig(nodes="each", num_gpus=2, base_model="other")]
    trainers = RayTrainers(f"first{uuid.uuid4().hex[:6]}", str(tmp_path / "state"), "fifo", StorageConfig(),
                           cluster_poll_s=FLEET_POLL_S)
    reference, intake, table, _, clock = fleet_with(tmp_path, RayTrainers("ref", str(tmp_path / "ref"), "fifo",
                                                                          StorageConfig()), kind=kinds)
    fleet = TrainerFleet(kinds, trainers, intake, trainer_timeout_s=60, cluster_poll_s=FLEET_POLL_S, clock=clock)
    monkeypatch.setattr(ray, "nodes", hangs)
    ticking = SchedulerTicks(clock, lambda: (fleet.follow_if_due(), fleet.watch_all()))
    ticking.thread.start()
    try:
        waits = ticking.lock_waits(table.all, 3)
        assert max(waits) < 1.5, max(waits)   # on this busy machine; it was the GCS's whole hang
        assert len(calls) == 1 and len(ticking.times) > 5, (calls, ticking.times)
        with ticking.lock:
            said = (fleet.why_none_runs(), fleet.unplanned(), fleet.all_settled(), fleet.waits_by_base())
        assert said == (READING_NODES, None, False, {("smollm2-135m", "none"): READING_NODES,
                                                     ("other", "none"): READING_NODES}), said
        answer.set()
        wait_for(lambda: fleet.nodes_read, timeout=30, what="the first read's answer")
        assert sorted(fleet.nodes) == sorted(node.id for node in alive_nodes())   # Ray's nodes, as it lists them
        with ticking.lock:
            after = (fleet.why_none_runs(), fleet.unplanned(), fleet.all_settled(), fleet.waits_by_base())
        before = (reference.why_none_runs(), reference.unplanned(), reference.all_settled(), reference.waits_by_base())
        assert after == before and "no node of the cluster has" in (after[1] or ""), (after, before)
    finally:
        answer.set()
        ticking.end()


def test_a_service_whose_gcs_hangs_on_its_first_node_read_answers_calls_and_says_it_reads_them(ray_session,
                                                                                                tiny_model_dirs,
                                                                                                tmp_path):
    """The scheduler actor itself, its process's `ray.nodes()` (Ray's read of this cluster's nodes) waiting on a gate
    (tests/helpers/slow_nodes.py, as its listeners factory): its first read was made in the tick, under the service's
    lock, and `info`, `submit` and `status` waited on the GCS. Now they answer while the read hangs, the service says it
    is reading the cluster's nodes (not that no node fits), and once the read answers it says what a service whose
    read was quick says (the reference: test_a_service_whose_gpu_trainers_no_node_can_hold_says_so_in_its_jobs_reason,
    Ray's resources: no GPU)."""
    import uuid

    from actors.scheduler_actor import SchedulerActor
    from actors.service.scheduler.config import NAMESPACE
    from actors.service.scheduler.trainer_fleet import READING_NODES

    assert ray_session.cluster_resources().get("GPU", 0) == 0, "this test needs a cluster without a GPU"
    base, gate = tiny_model_dirs["llama"], tmp_path / "gate"
    gate.touch()
    config = service_config(tmp_path / "state", base, num_gpus=1, nodes="each")
    hang = "tests.helpers.slow_nodes:hang_node_reads"   # its listeners factory, run as it starts: no listeners
    client = Client(SchedulerActor.options(name=f"hang-nodes-{uuid.uuid4().hex[:6]}", namespace=NAMESPACE).remote(
        config, hang), owned=True)
    try:
        client.info()   # the actor constructed
        began = time.monotonic()
        info = client.info()
        handle = client.submit(job_dict("waits", write_task_data(tmp_path / "data", "t"), 3), base_model=str(base))
        record = wait_for(lambda: (r := handle.status()).reason == READING_NODES and r, timeout=10,
                          what="the job's reason", state=lambda: handle.status())
        assert time.monotonic() - began < 12, time.monotonic() - began   # the read hangs throughout
        assert (info["nodes"], info["trainers"], "trainers_error" in info) == (READING_NODES, [], False), info
        assert record.state == "queued" and gate.exists()
        gate.unlink()   # the GCS answers
        record = wait_for(lambda: (r := handle.status()).reason.startswith("no trainer runs") and r, timeout=60,
                          what="the job's reason", state=lambda: handle.status())
        assert record.reason.startswith(f"no trainer runs: trainers[0] ({base}): no node of the cluster has a GPU: "
                                        "device: cuda (or num_gpus) asks for one per trainer"), record.reason
        info = client.info()
        assert "nodes" not in info and info["trainers_error"].startswith(
            f"no trainer runs: trainers[0] ({base}): no node of the cluster has a GPU"), info
    finally:
        gate.unlink(missing_ok=True)
        client.shutdown()

NODE_JOINS = """
import json, sys, time
import ray
from ray.cluster_utils import Cluster
from actors.ray_trainers import RayTrainers
from actors.service.scheduler.config import StorageConfig

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
ray.init(address=cluster.address)
trainers = RayTrainers("join", sys.argv[1], "fifo", StorageConfig(), cluster_poll_s=1.0)
trainers.nodes(fresh=True)   # the first read, at start
joined = cluster.add_node(num_cpus=1).node_id   # returns once Ray's GCS lists it
looks = 1
while joined not in {node.id for node in trainers.nodes() or []} and looks < 20:   # a look every cluster_poll_s
    looks += 1
    time.sleep(1.0)
print(json.dumps({"looks": looks, "listed": joined in {node["NodeID"] for node in ray.nodes() if node["Alive"]}}))
ray.shutdown()
cluster.shutdown()
"""


def test_a_node_that_joins_is_seen_by_the_fleets_looks_within_two(tmp_path):
    """The live nodes are read off the service's lock, each look at them (RayTrainers.nodes, every cluster_poll_s)
    using the answer of the read the one before started: a node that joins a real cluster (Ray's own test cluster, a
    second raylet) is in the looks' nodes within two looks of Ray's GCS listing it (docs/cluster.md's bound)."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", NODE_JOINS, str(tmp_path / "state")], capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["listed"] and result["looks"] <= 2, result
