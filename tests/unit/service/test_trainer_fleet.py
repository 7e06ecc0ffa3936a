"""The trainer fleet without Ray (`actors/service/scheduler/trainer_fleet.py`): fakes stand in for the trainers and
the cluster; the events go through the real event intake into a real job table and scheduler core. A
trainer that dies or stops answering is replaced (its jobs queued again once what it reported before is
booked); one Ray reports unavailable is asked again until its grace runs out or its node is known gone;
a node that leaves retires its trainers, one that joins gets its own; a trainer that cannot start says
why; a stopping fleet collects each trainer's last events."""

from __future__ import annotations

import logging

import pytest

from actors.service.scheduler.config import TrainerConfig
from actors.service.scheduler.trainer_fleet import (
    UNAVAILABLE_GRACE_S,
    TrainerCallFailed,
    TrainerUnavailable,
)
from actors.service.trainer.trainer_reports import TrainerEvent
from tests.helpers.fleet_fakes import (
    CLUSTER_POLL_S,
    HEAD,
    JOINER,
    TIMEOUT_S,
    WORKER,
    FakeCluster,
    bring_up,
    fleet_with,
)
from tests.helpers.scheduler_fakes import progress


def test_trainers_start_on_each_node_and_their_events_reach_the_table(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, intake, table, (a, b), _ = fleet_with(tmp_path, cluster)
    assert [(t.trainer_id, t.node, t.threads) for t in cluster.started] == [
        ("trainer-0", HEAD.id, 2), ("trainer-1", WORKER.id, 4)]      # each sized from its own node
    assert not fleet.all_settled() and fleet.ready_statuses() == []
    bring_up(fleet, cluster)
    assert fleet.all_settled() and [s.trainer_id for s in fleet.ready_statuses()] == ["trainer-0", "trainer-1"]
    cluster.current("trainer-0").answer_poll([progress(a, 1), progress(b, 1)], jobs=[a, b])
    fleet.watch_all()
    assert intake.waiting("trainer-0") == 2 and table.progress.of_job(a) == []
    assert intake.apply_all()
    assert table.get(a).step == 1 and table.get(b).step == 1
    described = {t["id"]: t for t in fleet.describe()}
    assert described["trainer-1"]["node_address"] == WORKER.address and described["trainer-1"]["ready"]
    assert described["trainer-0"]["actor_name"] == "svc.trainer-0.0" and described["trainer-0"]["jobs"] == [a, b]
    fleet.assign("trainer-1", [("job", "...")])
    fleet.stop_job("trainer-0", a, "paused", "preempted")
    assert cluster.current("trainer-1").assigned == [[("job", "...")]]
    assert cluster.current("trainer-0").stops == [(a, "paused", "preempted")]
    with pytest.raises(ValueError, match=f"job {a} is on trainer trainer-7, which this service does not have"):
        fleet.stop_job("trainer-7", a, "paused", "preempted")


def test_a_dead_trainer_is_replaced_and_only_its_unfinished_jobs_start_again(tmp_path, caplog):
    cluster = FakeCluster(HEAD)
    fleet, intake, table, (a, b), _ = fleet_with(tmp_path, cluster)
    bring_up(fleet, cluster)
    first = cluster.current("trainer-0")
    first.answer_poll([progress(a, 1), TrainerEvent(kind="completed", job_id=a, step=1, data={"reason": "done"}),
                       progress(b, 1)])
    fleet.watch_all()                       # its events wait for the table
    fleet.watch_all()                       # the next poll is sent...
    first.polls[-1].fail(TrainerCallFailed("ActorDiedError", "the actor died unexpectedly"))
    with caplog.at_level(logging.WARNING):
        fleet.watch_all()                   # ...and fails: a new trainer starts
    assert "trainer trainer-0 lost (ActorDiedError); starting a new one" in caplog.text
    second = cluster.current("trainer-0")
    assert first.killed and second is not first and second.attempt == 1 and second.node == HEAD.id
    [described] = fleet.describe()
    assert described["restarts"] == 1 and not described["ready"] and described["actor_name"] == "svc.trainer-0.1"
    assert intake.apply_all()
    assert table.get(a).state == "completed"                    # what it finished before it died stays done
    record = table.get(b)
    assert record.state == "queued" and "trainer trainer-0 was lost (ActorDiedError)" in record.reason
    # no checkpoint reported: one may still have been written after the last report the table booked
    assert record.reason.endswith("resumes from its newest checkpoint, if one was written after the last report, "
                                  "else the start"), record.reason
    bring_up(fleet, cluster)                # the new one loads and is polled like the first
    assert fleet.ready_statuses()[0].trainer_id == "trainer-0" and len(second.polls) == 1


def test_a_trainer_that_stops_answering_is_replaced_after_trainer_timeout_s(tmp_path):
    cluster = FakeCluster(HEAD)
    fleet, intake, table, (a, _), clock = fleet_with(tmp_path, cluster)
    bring_up(fleet, cluster)
    clock.now += TIMEOUT_S - 1
    fleet.watch_all()
    assert len(cluster.started) == 1        # slow, not yet lost
    clock.now += 2
    fleet.watch_all()
    assert len(cluster.started) == 2 and cluster.started[0].killed
    assert intake.apply_all()
    assert f"was lost (no answer for {TIMEOUT_S:.0f}s)" in table.get(a).reason


def test_an_unavailable_trainer_is_asked_again_until_its_grace_runs_out(tmp_path):
    cluster = FakeCluster(HEAD)
    fleet, intake, table, (a, _), clock = fleet_with(tmp_path, cluster)
    bring_up(fleet, cluster)
    trainer = cluster.current("trainer-0")
    trainer.polls[-1].fail(TrainerUnavailable("ActorUnavailableError", "connection reset"))
    fleet.watch_all()
    fleet.watch_all()                       # asked again, not replaced
    assert len(cluster.started) == 1 and len(trainer.polls) == 2
    trainer.answer_poll()                   # it came back: the grace starts over next time
    fleet.watch_all()
    for _ in range(3):                      # unavailable again and again, within the grace
        fleet.watch_all()
        trainer.polls[-1].fail(TrainerUnavailable("ActorUnavailableError", "connection reset"))
        fleet.watch_all()
        clock.now += UNAVAILABLE_GRACE_S / 3 - 1
    assert len(cluster.started) == 1 and table.get(a).state == "running"
    fleet.watch_all()
    trainer.polls[-1].fail(TrainerUnavailable("ActorUnavailableError", "connection reset"))
    clock.now += 4
    fleet.watch_all()                       # past the grace: replaced
    assert len(cluster.started) == 2 and trainer.killed
    assert intake.apply_all()
    assert f"ActorUnavailableError for {UNAVAILABLE_GRACE_S:.0f}s" in table.get(a).reason


def test_a_node_that_leaves_retires_its_trainer_and_a_node_that_joins_gets_one(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, intake, table, (a, b), clock = fleet_with(tmp_path, cluster, trainer="trainer-1")
    bring_up(fleet, cluster)
    lost = cluster.current("trainer-1")
    cluster.live = [HEAD]                   # the worker dies: Ray first reports its trainer unavailable
    lost.polls[-1].fail(TrainerUnavailable("ActorUnavailableError", "node died"))
    fleet.watch_all()
    assert lost.killed and len(cluster.started) == 2                   # retired, not started again
    assert [(t["retired"], t["phase"]) for t in fleet.describe()] == [(False, "ready"), (True, "retired")]
    assert [s.trainer_id for s in fleet.ready_statuses()] == ["trainer-0"]
    fleet.assign("trainer-1", [("job", "...")])                        # what was on its way there is dropped
    assert lost.assigned == []
    assert fleet.drop_retired() == []
    assert "trainer-1" in fleet.slots       # until what it reported (its loss) is in the table
    assert intake.apply_all()
    assert fleet.drop_retired() == ["trainer-1"]   # the listeners hear it is gone (its metrics series go)
    assert list(fleet.slots) == ["trainer-0"]
    for job_id in (a, b):
        record = table.get(job_id)
        assert record.state == "queued" and f"its node {WORKER.id[:8]} left the cluster" in record.reason
    cluster.live = [HEAD, JOINER]
    clock.now += CLUSTER_POLL_S - 1
    fleet.follow_if_due()
    assert len(cluster.started) == 2        # the cluster is read every cluster_poll_s
    clock.now += 1
    fleet.follow_if_due()
    joined = cluster.started[-1]
    assert (joined.trainer_id, joined.node, joined.threads) == ("trainer-2", JOINER.id, 1)


def test_an_any_trainer_whose_node_left_starts_again_on_a_live_node(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, intake, table, (a, _), _ = fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="any"))
    assert [t.node for t in cluster.started] == [WORKER.id]           # the node with the most CPUs free
    bring_up(fleet, cluster)
    cluster.live = [HEAD]
    fleet.follow(cluster.nodes())
    moved = cluster.current("trainer-0")
    assert cluster.started[0].killed and moved.node == HEAD.id and moved.attempt == 1 and moved.threads == 2
    assert intake.apply_all()
    assert f"its node {WORKER.id[:8]} left the cluster" in table.get(a).reason


def test_a_trainer_that_cannot_start_says_why_and_one_whose_node_left_is_retired(tmp_path):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, intake, _, _, _ = fleet_with(tmp_path, cluster)
    cluster.current("trainer-0").ready.fail(TrainerCallFailed("RayTaskError", OSError("no such model: x")))
    fleet.watch_all()
    assert not fleet.all_settled()          # trainer-1 is still loading
    cluster.live = [HEAD]
    cluster.current("trainer-1").ready.fail(TrainerCallFailed("RayActorError", "its node died"))
    fleet.watch_all()
    described = {t["id"]: t for t in fleet.describe()}
    assert described["trainer-0"]["error"] == "could not start: no such model: x"
    assert described["trainer-1"]["retired"] and described["trainer-1"]["error"] is None
    assert fleet.all_settled()              # a retired trainer is not waited for: it never starts again
    assert intake.apply_all()
    fleet.drop_retired()
    assert fleet.all_settled() and list(fleet.slots) == ["trainer-0"]
    assert fleet.why_none_runs() == "trainer trainer-0 could not start: no such model: x"
    assert len(cluster.started) == 2        # neither is started again


def test_a_stopping_fleet_collects_each_trainers_last_events(tmp_path, caplog):
    cluster = FakeCluster(HEAD, WORKER)
    fleet, _, _, (a, _), _ = fleet_with(tmp_path, cluster)
    bring_up(fleet, cluster)
    paused = TrainerEvent(kind="paused", job_id=a, step=3, data={"checkpoint_step": 3})
    cluster.current("trainer-0").last_words.give([paused])
    cluster.current("trainer-1").last_words.fail(TrainerCallFailed("GetTimeoutError", "no answer in 180 s"))
    with caplog.at_level(logging.WARNING):
        assert fleet.shutdown() == [("trainer-0", [paused])]
    assert "trainer trainer-1 did not shut down cleanly: GetTimeoutError: no answer in 180 s" in caplog.text
    fleet.kill_all()
    assert all(t.killed for t in cluster.started)


def test_a_poll_in_flight_at_shutdown_keeps_its_events(tmp_path):
    """A trainer's poll sent just before the service stops answers before its shutdown (the actor takes calls
    in order): the step it reports is not lost (the job table kept step 0 of a job checkpointed at step 1)."""
    cluster = FakeCluster(HEAD)
    fleet, _, _, (a, *_), _ = fleet_with(tmp_path, cluster)
    bring_up(fleet, cluster)
    fleet.watch_all()                       # a poll goes out
    trainer = cluster.current("trainer-0")
    assert trainer.polls and not trainer.polls[-1].done()
    step = progress(a, 1)
    trainer.answer_poll([step])
    paused = TrainerEvent(kind="paused", job_id=a, step=1, data={"checkpoint_step": 1})
    trainer.last_words.give([paused])
    assert fleet.shutdown() == [("trainer-0", [step, paused])]


def test_two_cpu_trainers_on_one_node_start_with_half_its_ram_share_each(tmp_path):
    """cluster_plan.py's share of the node's RAM reaches each launch (the trainer's default budget: that share of
    half the RAM), as its threads do; alone on a node a trainer keeps the whole half."""
    cluster = FakeCluster(HEAD)
    fleet_with(tmp_path, cluster, kind=TrainerConfig(nodes="each", count=2))
    assert [(t.node, t.threads, t.ram_share) for t in cluster.started] == [(HEAD.id, 1, 0.5), (HEAD.id, 1, 0.5)]
    alone = FakeCluster(WORKER)
    fleet_with(tmp_path / "alone", alone)
    assert [t.ram_share for t in alone.started] == [1.0]
