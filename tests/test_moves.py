"""The scheduler core carrying out a `Move` in-process (no Ray): three jobs started while only one trainer
was up; once a second trainer is there, one job is paused with a checkpoint on the first and started,
pinned, on the second when its pause lands; it is not moved back, and a target gone before the pause
lands leaves the job to the policy."""

from __future__ import annotations

from actors.service.job_table import JobTable
from actors.service.scheduler_core import SchedulerCore
from actors.service.trainer_reports import TrainerEvent
from policies.base import Move, Start
from policies.ordering import AdaptivePolicy
from tests.service_helpers import job_dict, run_spec, write_task_data
from tests.test_trainer_loop import fake_status


def three_jobs_on_one_trainer(tmp_path) -> tuple[SchedulerCore, list[str], list]:
    data = write_task_data(tmp_path / "data", "t")
    spec = run_spec("smollm2-135m", tmp_path / "out", [job_dict(f"j{i}", data, 200) for i in range(3)])
    decisions: list = []
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), AdaptivePolicy(), tmp_path / "state",
                         on_decision=lambda *d: decisions.append(d[:2]))
    ids = [r.id for r in core.submit_many(spec.submissions())]
    with core.table.transaction():     # trainer-1 is still loading: all three go to trainer-0
        assert core.plan([fake_status("trainer-0", "smollm2-135m")]) == [Start(i, "trainer-0") for i in ids]
    with core.table.transaction():
        for job_id in ids:
            core.apply_event("trainer-0", TrainerEvent("started", job_id, 0, {"total_steps": 200}))
            core.apply_event("trainer-0", TrainerEvent("progress", job_id, 10, {"step": 10, "loss": 1.0,
                                                                                 "tokens": 2000}))
            core.apply_event("trainer-0", TrainerEvent("checkpoint", job_id, 10, {}))
    return core, ids, decisions


def test_the_core_moves_a_job_to_an_idle_trainer_and_resumes_it_there(tmp_path):
    core, ids, decisions = three_jobs_on_one_trainer(tmp_path)
    both = lambda t0, t1: [fake_status("trainer-0", "smollm2-135m", jobs=t0),   # noqa: E731
                           fake_status("trainer-1", "smollm2-135m", jobs=t1)]
    with core.table.transaction():
        actions = core.plan(both(ids, []))
    assert len(actions) == 1 and isinstance(actions[0], Move) and actions[0].trainer == "trainer-1"
    moved = actions[0].job
    record = core.table.get(moved)
    assert record.state == "running" and record.trainer == "trainer-0" and "pausing on trainer-0" in record.reason
    assert ("move", moved) in decisions
    with core.table.transaction():     # still pausing: nothing else moves, nothing moves twice
        assert core.plan(both(ids, [])) == []
    with core.table.transaction():     # the pause lands with its checkpoint
        core.apply_event("trainer-0", TrainerEvent("paused", moved, 12, {"checkpoint_step": 12}))
    record = core.table.get(moved)
    assert record.state == "queued" and record.checkpoint_step == 12 and "resumes on trainer-1" in record.reason
    others = [i for i in ids if i != moved]
    with core.table.transaction():     # the next round starts it on its target, before the policy decides
        assert core.plan(both(others, [])) == [Start(moved, "trainer-1")]
    assert core.table.get(moved).trainer == "trainer-1"
    with core.table.transaction():
        core.apply_event("trainer-1", TrainerEvent("started", moved, 12, {"resumed_from": 12, "total_steps": 200}))
    record = core.table.get(moved)
    assert record.state == "running" and "resumed from step 12" in record.reason and record.step == 12
    for _ in range(3):                 # balanced now (2 + 1): nothing moves back or on
        with core.table.transaction():
            assert core.plan(both(others, [moved])) == []
    assert [kind for kind, _ in decisions].count("move") == 1


def test_a_move_whose_target_is_gone_leaves_the_job_to_the_policy(tmp_path):
    core, ids, _ = three_jobs_on_one_trainer(tmp_path)
    with core.table.transaction():
        [move] = core.plan([fake_status("trainer-0", "smollm2-135m", jobs=ids),
                            fake_status("trainer-1", "smollm2-135m")])
    with core.table.transaction():
        core.apply_event("trainer-0", TrainerEvent("paused", move.job, 11, {"checkpoint_step": 11}))
    others = [i for i in ids if i != move.job]
    with core.table.transaction():     # trainer-1 died meanwhile: the policy starts the job where it fits
        actions = core.plan([fake_status("trainer-0", "smollm2-135m", jobs=others)])
    assert actions == [Start(move.job, "trainer-0")]
    assert core.moving == {}
