"""An interactive model (the Tinker API's) placed against what a batch job of the service is held to, found short
by its author (actors/service/scheduler/interactive_jobs.py):

- a model whose adapter and AdamW state fit no trainer of its base even alone was refused for now (NoRoom: 503,
  retried by the SDK for ~5 minutes); it is refused at once (ValueError: 422) with the sizes and what to change,
  as the same core fails a batch job of the same rank and modules that can never run (`never_fits`);
- a model whose trainer was lost was placed again without its user's `max_running` checked: their queued job that
  the policy started meanwhile left them one over; it now waits (NoRoom, which its front tries again) until a job
  of theirs ends, as the policy's own `Admission` keeps a queued job of theirs waiting;
- a job moving to a trainer (a `Move` in flight) was not counted there: a model opened in its room, and the moved
  job went back to the policy when its pause landed (a wasted move); it counts now, as `Admission` counts it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.service.accounts.users import UserBook
from actors.service.scheduler.interactive_jobs import NoRoom, OverQuota
from actors.service.scheduler.job_fit import job_adapter_bytes, trainer_view
from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.base import Admission, Move, Start, UserShare
from policies.fifo import FifoPolicy
from policies.ordering import AdaptivePolicy
from tests.helpers.policy_service import core_with, more_jobs
from tests.helpers.scheduler_fakes import status
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status

pytestmark = pytest.mark.unit

BASE = "smollm2-135m"


def test_a_model_no_trainer_can_hold_even_alone_is_refused_at_once_as_a_batch_job_of_its_size_fails(tmp_path):
    core, (alpha,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))   # lora r=4 on q_proj, v_proj
    roomy = status("trainer-0")
    need = job_adapter_bytes(core.table.submission(alpha.id).job.lora, trainer_view(roomy))
    view = trainer_view(roomy)
    small = replace(roomy, memory_budget_bytes=view.base_bytes + view.step_memory_bytes + need // 2)
    with pytest.raises(ValueError) as refused:
        with core.table.transaction():
            core.interactive.open("s1:train:0", BASE, 4, "bob", [small])
    assert not isinstance(refused.value, NoRoom), "refused for now: the SDK retries it for ~5 minutes"
    assert str(refused.value).startswith(f"model of {BASE} cannot run on any trainer: its adapter (rank=4) needs "
                                         "0 MiB but trainer-0's memory budget (150 MiB) leaves 0 MiB after the base "
                                         "model and a full step; create it with a lower rank"), str(refused.value)
    assert "train_mlp=False" in str(refused.value) and "larger memory_budget_bytes" in str(refused.value)
    assert core.table.all(("running",)) == [] and len(core.table.all()) == 1   # nothing entered
    # the reference: the policy's own Admission never fits a batch job of that size there, and the core fails it
    snapshot = core.snapshot([roomy])
    (job,) = snapshot.jobs
    alone = replace(snapshot, trainers=(trainer_view(small),))
    assert job.memory_bytes == need and not Admission(alone).fits(alone.trainers[0], job)
    with core.table.transaction():
        assert core.plan([small]) == []
    failed = core.table.get(alpha.id)
    assert failed.state == "failed" and failed.reason.startswith("cannot run on any trainer: its adapter (lora.r=4)")
    # a trainer that holds it alone, but whose memory other models hold now: refused for now (it waits)
    fits_alone = replace(roomy, memory_budget_bytes=view.base_bytes + view.step_memory_bytes + need + need // 2)
    with core.table.transaction():
        first = core.interactive.open("s1:train:1", BASE, 4, "bob", [fits_alone])
    with pytest.raises(NoRoom, match="try again when a job there ends"):
        with core.table.transaction():
            core.interactive.open("s1:train:2", BASE, 4, "bob", [replace(fits_alone, jobs=[first.record.id])])
    # bob at his max_running: told at once that it never fits, not over quota (a 429 the SDK retries ~5 minutes)
    with pytest.raises(ValueError, match="cannot run on any trainer") as never:
        core.interactive.open("s1:train:3", BASE, 4, "bob", [small], standing=UserShare(max_running=1))
    assert not isinstance(never.value, NoRoom)


def test_a_lost_trainers_model_waits_while_its_user_runs_their_max_running_jobs(tmp_path):
    book = UserBook.in_state_dir(tmp_path / "state")
    book.add("alice", quotas={"running": 1})
    core, (alpha,) = core_with(FifoPolicy(), tmp_path, names=("alpha",))
    core.table.update(alpha.id, user="alice")
    t0, t1 = status("trainer-0"), status("trainer-1")
    with core.table.transaction():
        model = core.interactive.open("s1:train:0", BASE, 4, "alice", [t0], standing=core.standing()["alice"])
    job = model.record.id
    with core.table.transaction():   # alice runs her one job: alpha waits
        assert core.plan([replace(t0, jobs=[job]), t1]) == []
    assert core.table.get(alpha.id).state == "queued"
    with core.table.transaction():
        core.trainer_lost("trainer-0", "killed")
    with core.table.transaction():   # the policy starts her alpha while the model waits for its front
        assert core.plan([t1]) == [Start(alpha.id, "trainer-1")]
    (beta,) = more_jobs(core, tmp_path, "beta")   # the reference: the policy's own Admission holds her at one
    core.table.update(beta.id, user="alice")
    snapshot = core.snapshot([t1])
    assert Admission(snapshot).quota_reason(next(j for j in snapshot.jobs if j.id == beta.id)) is not None
    with pytest.raises(NoRoom) as waits:
        with core.table.transaction():
            core.interactive.reopen(job, "trainer-0", [replace(t1, jobs=[alpha.id])],
                                    standing=core.standing()["alice"])
    assert not isinstance(waits.value, OverQuota), "a 429: its front gives up at once (it tries a 503 again)"
    assert str(waits.value).startswith("user alice runs 1 jobs (alpha), their max_running quota (1"), str(waits.value)
    core.interactive.waits(job, str(waits.value))   # what the scheduler actor says on the model meanwhile
    record = core.table.get(job)
    assert record.state == "queued" and "its trainer was lost; waiting to be placed again: user alice runs" in \
        record.reason
    assert [r.id for r in core.table.all(("running",)) if r.user == "alice"] == [alpha.id]
    with core.table.transaction():
        core.table.set_state(alpha.id, "cancelled", "cancelled by alice", trainer=None)
        core.table.set_state(beta.id, "cancelled", "cancelled by alice")
    with pytest.raises(NoRoom, match="no ready trainer holds smollm2-135m now"):   # trainer-0's successor loading
        with core.table.transaction():
            core.interactive.reopen(job, "trainer-0", [], standing=core.standing()["alice"])
    with core.table.transaction():   # her job ended: the model is placed again
        placed = core.interactive.reopen(job, "trainer-0", [t1], standing=core.standing()["alice"])
    assert placed.trainer == "trainer-1" and core.table.get(job).state == "running"


def test_a_model_does_not_take_the_slot_of_a_job_moving_to_that_trainer(tmp_path):
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec(BASE, tmp_path / "out", [job_dict(f"j{i}", data, 200) for i in range(3)])
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), AdaptivePolicy(), tmp_path / "state")
    ids = [r.id for r in core.submit_many(spec.submissions())]
    with core.table.transaction():   # trainer-1 is still loading: all three start on trainer-0
        assert core.plan([fake_status("trainer-0", BASE)]) == [Start(i, "trainer-0") for i in ids]
    with core.table.transaction():
        for job_id in ids:
            core.apply_event("trainer-0", TrainerEvent(kind="started", job_id=job_id, step=0,
                                                       data={"total_steps": 200}))
            core.apply_event("trainer-0", TrainerEvent(kind="checkpoint", job_id=job_id, step=10))
    t1 = replace(fake_status("trainer-1", BASE), max_jobs=1)
    with core.table.transaction():
        (move,) = core.plan([fake_status("trainer-0", BASE, jobs=ids), t1])
    assert isinstance(move, Move) and move.trainer == "trainer-1"
    # the reference: the policy's own Admission counts the job on its way as holding trainer-1's one slot
    admission = Admission(snapshot := core.snapshot([fake_status("trainer-0", BASE, jobs=ids), t1]))
    assert not admission.has_slot(next(t for t in snapshot.trainers if t.id == "trainer-1"))
    with pytest.raises(NoRoom, match=r"trainer-1 runs 1 jobs, its max_jobs \(1\)"):   # still pausing on trainer-0
        with core.table.transaction():
            core.interactive.open("s1:train:0", BASE, 4, "bob", [t1])
    with core.table.transaction():   # the pause lands: queued, to start on trainer-1 at the next round
        core.apply_event("trainer-0", TrainerEvent(kind="paused", job_id=move.job, step=12,
                                                   data={"checkpoint_step": 12}))
    with pytest.raises(NoRoom, match=r"trainer-1 runs 1 jobs, its max_jobs \(1\)"):
        with core.table.transaction():
            core.interactive.open("s1:train:0", BASE, 4, "bob", [t1])
    others = [i for i in ids if i != move.job]
    with core.table.transaction():   # the move is carried out, not handed back to the policy
        assert core.plan([fake_status("trainer-0", BASE, jobs=others), t1]) == [Start(move.job, "trainer-1")]
    assert "no longer holds it" not in core.table.get(move.job).reason
    with core.table.transaction():   # trainer-0 has room: the model opens there
        assert core.interactive.open("s1:train:0", BASE, 4, "bob", [fake_status("trainer-0", BASE, jobs=others),
                                                                    t1]).trainer == "trainer-0"
