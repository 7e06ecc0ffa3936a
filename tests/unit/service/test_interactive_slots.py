"""An interactive model (the Tinker API's) is a running job as a policy's placement counts one: it takes a job slot
of its trainer (`max_jobs`), one of its node's (`job_processes_per_node`) and one of its user's `max_running`. It
was once placed by memory alone: a model opened on a trainer already running its `max_jobs`, past the limit the
operator configured. Now it opens only where a policy's `Start` of a job could go (the reference: the built-in
`Admission` of the same service's snapshot, which places batch jobs, and the policy's own decision for a job queued
beside the model); where none has room it is refused for now (NoRoom: the SDK's create is answered 503 and
retried), a user at their `max_running` is refused as over quota (OverQuota, 429), and a quota of 0, which never
lets it run, at once (ValueError, 422). The SDK's retry of a create already carried out is answered with the model,
which holds its slot already."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.service.scheduler.interactive_jobs import NoRoom, OverQuota
from policies.base import Admission, UserShare
from policies.fifo import FifoPolicy
from tests.helpers.policy_service import core_with, more_jobs
from tests.helpers.trainer import fake_status

pytestmark = pytest.mark.unit

BASE = "smollm2-135m"
NODE = "node-a1b2c3d4e5f6a7b8"


def admission(core, trainers) -> tuple[Admission, dict]:
    """The built-in placement on the service's snapshot now, and its trainers' views by id."""
    snapshot = core.snapshot(trainers)
    return Admission(snapshot), {t.id: t for t in snapshot.trainers}


def test_a_model_opens_only_on_a_trainer_with_a_free_job_slot_as_a_policys_start_would(tmp_path):
    core, (alpha,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))
    roomy = replace(fake_status("trainer-0", BASE, budget=40 * 2**30), max_jobs=1)   # the most memory
    small = replace(fake_status("trainer-1", BASE), max_jobs=1)
    with core.table.transaction():   # the round starts alpha on trainer-0: running there, not reported yet
        assert [(a.job, a.trainer) for a in core.plan([roomy, small])] == [(alpha.id, "trainer-0")]
    placement, views = admission(core, [roomy, small])
    assert not placement.has_slot(views["trainer-0"]) and placement.has_slot(views["trainer-1"])
    with core.table.transaction():
        opened = core.interactive.open("s1:train:0", BASE, 8, "bob", [roomy, small])
    assert opened.trainer == "trainer-1", "placed by memory alone, past trainer-0's max_jobs"
    placement, views = admission(core, [roomy, small])
    assert not placement.has_slot(views["trainer-0"]) and not placement.has_slot(views["trainer-1"])
    with pytest.raises(NoRoom) as refused:
        with core.table.transaction():
            core.interactive.open("s1:train:1", BASE, 8, "bob", [roomy, replace(small, jobs=[opened.record.id])])
    assert not isinstance(refused.value, OverQuota)
    assert str(refused.value) == (
        "no ready trainer holding smollm2-135m has room for a rank-8 model now (trainer-0 runs 1 jobs, its "
        "max_jobs (1); trainer-1 runs 1 jobs, its max_jobs (1)); try again when a job there ends, or an operator "
        "raises the trainer's max_jobs (its settings in the service config)")
    assert [r.id for r in core.table.all(("running",))] == [alpha.id, opened.record.id]
    # the policy counts the model in trainer-1's slot too: a job queued now waits for a free slot
    (beta,) = more_jobs(core, tmp_path, "beta")
    with core.table.transaction():
        assert core.plan([roomy, small]) == []
    assert core.table.get(beta.id).reason.startswith("waiting for a free slot"), core.table.get(beta.id).reason


def test_the_sdks_retry_of_a_created_model_is_answered_with_it_though_its_slot_is_taken_by_it(tmp_path):
    core, _ = core_with(FifoPolicy(), tmp_path, names=("alpha",))   # queued, never planned here
    one = replace(fake_status("trainer-0", BASE), max_jobs=1)
    with core.table.transaction():
        opened = core.interactive.open("s1:train:0", BASE, 8, "bob", [one], standing=UserShare(max_running=1))
    reported = replace(one, jobs=[opened.record.id])
    with core.table.transaction():
        again = core.interactive.open("s1:train:0", BASE, 8, "bob", [reported], standing=UserShare(max_running=1))
    assert (again.record.id, again.trainer) == (opened.record.id, "trainer-0")
    assert [r.id for r in core.table.all(("running",))] == [opened.record.id]


def test_a_model_takes_one_of_its_nodes_job_slots_as_a_policys_start_would(tmp_path):
    core, (alpha,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))
    core.node_of = lambda trainer_id: NODE   # both trainers on one node, which holds one running job
    core.job_slots = {NODE: 1}
    first, second = fake_status("trainer-0", BASE), fake_status("trainer-1", BASE)
    with core.table.transaction():
        assert [a.job for a in core.plan([first, second])] == [alpha.id]
    placement, views = admission(core, [first, second])
    assert not placement.host_room(views["trainer-1"])
    with pytest.raises(NoRoom, match=r"trainer-1's node node-a1b2c3d runs 1 jobs, its job slots "
                                     r"\(job_processes_per_node: 1\).*raises job_processes_per_node"):
        with core.table.transaction():
            core.interactive.open("s1:train:0", BASE, 8, "bob", [first, second])
    core.job_slots = {NODE: 2}
    with core.table.transaction():
        assert core.interactive.open("s1:train:0", BASE, 8, "bob", [first, second]).trainer in {"trainer-0",
                                                                                               "trainer-1"}


def test_a_user_at_their_max_running_is_refused_over_quota_and_a_quota_of_0_at_once(tmp_path):
    core, (alpha,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))
    core.table.update(alpha.id, user="alice")
    trainer = fake_status("trainer-0", BASE)
    with core.table.transaction():
        assert [a.job for a in core.plan([trainer])] == [alpha.id]
    standing = UserShare(max_running=1)
    (beta,) = more_jobs(core, tmp_path, "beta")
    core.table.update(beta.id, user="alice")
    snapshot = replace(core.snapshot([trainer]), users={"alice": standing})
    queued = next(j for j in snapshot.jobs if j.id == beta.id)
    assert Admission(snapshot).quota_reason(queued) is not None   # the reference: her next job waits
    with pytest.raises(OverQuota) as refused:
        core.interactive.open("s1:train:0", BASE, 8, "alice", [trainer], standing=standing)
    assert str(refused.value) == (
        "user alice runs 1 jobs (alpha), their max_running quota (1; an interactive model counts as one); a model "
        "can be created once one of them ends, or an admin raises it (aspen user set alice --quota running=N)")
    with pytest.raises(ValueError, match=r"alice's max_running quota is 0: .*aspen user set alice --quota running=N"):
        core.interactive.open("s1:train:0", BASE, 8, "alice", [trainer], standing=UserShare(max_running=0))
    with core.table.transaction():   # bob, with no quota, opens beside alpha
        assert core.interactive.open("s1:train:0", BASE, 8, "bob", [trainer], standing=standing).trainer == "trainer-0"
