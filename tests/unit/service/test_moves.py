"""The scheduler core carrying out a `Move` in-process (no Ray): three jobs started while only one trainer
was up; once a second trainer is there, one job is paused with a checkpoint on the first and started,
pinned, on the second when its pause lands; it is not moved back, and a target gone before the pause
lands leaves the job to the policy. With real trainer loops, the moved job's adapter equals a solo run's."""

from __future__ import annotations

import json

from actors.service.scheduler.scheduler_core import SchedulerCore
from actors.service.table.job_table import JobTable
from actors.service.trainer.trainer_reports import TrainerEvent
from policies.base import Move, Start
from policies.ordering import AdaptivePolicy
from tests.helpers.service import job_dict, run_spec, write_task_data
from tests.helpers.trainer import fake_status


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
            core.apply_event("trainer-0", TrainerEvent(kind="started", job_id=job_id, step=0,
                                                       data={"total_steps": 200}))
            core.apply_event("trainer-0", TrainerEvent(kind="progress", job_id=job_id, step=10,
                                                       data={"step": 10, "loss": 1.0, "tokens": 2000}))
            core.apply_event("trainer-0", TrainerEvent(kind="checkpoint", job_id=job_id, step=10))
    return core, ids, decisions


def test_the_core_moves_a_job_to_an_idle_trainer_and_resumes_it_there(tmp_path):
    core, ids, decisions = three_jobs_on_one_trainer(tmp_path)
    both = lambda t0, t1: [fake_status("trainer-0", "smollm2-135m", jobs=t0),   # noqa: E731 - the two trainers' statuses, built inline per call
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
        core.apply_event("trainer-0", TrainerEvent(kind="paused", job_id=moved, step=12,
                                                   data={"checkpoint_step": 12}))
    record = core.table.get(moved)
    assert record.state == "queued" and record.checkpoint_step == 12 and "resumes on trainer-1" in record.reason
    others = [i for i in ids if i != moved]
    with core.table.transaction():     # the next round starts it on its target, before the policy decides
        assert core.plan(both(others, [])) == [Start(moved, "trainer-1")]
    assert core.table.get(moved).trainer == "trainer-1"
    with core.table.transaction():
        core.apply_event("trainer-1", TrainerEvent(kind="started", job_id=moved, step=12,
                                                   data={"resumed_from": 12, "total_steps": 200}))
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
        core.apply_event("trainer-0", TrainerEvent(kind="paused", job_id=move.job, step=11,
                                                   data={"checkpoint_step": 11}))
    others = [i for i in ids if i != move.job]
    with core.table.transaction():     # trainer-1 died meanwhile: the policy starts the job where it fits
        actions = core.plan([fake_status("trainer-0", "smollm2-135m", jobs=others)])
    assert actions == [Start(move.job, "trainer-0")]
    assert all(state.moving_to is None for state in core.scheduling.values())   # the pin is dropped


def test_a_job_moved_between_real_trainer_loops_ends_like_a_solo_run(tmp_path, tiny_model_dirs):
    """Two in-process trainer loops under the core, with the steps the scheduler actor takes each tick: three
    jobs start on trainer-0 while trainer-1 is not up; once it is, one moves there, resumes from the
    checkpoint its pause wrote, and its adapter equals an uninterrupted solo run's."""
    from actors.engine.models import load_base_model
    from actors.service.scheduler.config import TrainerConfig
    from actors.service.scheduler.local_run import train_locally
    from actors.service.trainer.trainer_loop import TrainerLoop
    from tests.helpers.service import adapter_tensors, max_relative_difference
    from tests.helpers.trainer import assignment_for

    path = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    jobs = [job_dict(f"m{i}", write_task_data(data, f"m{i}", offset=i), 16, checkpoint_every=1000,
                    batch_size=2, max_seq_len=48) for i in range(3)]
    spec = run_spec(path, tmp_path / "out", jobs, step_tokens=512)
    loops = {tid: TrainerLoop(load_base_model(path, dtype="float32", device="cpu"),
                              TrainerConfig(base_model=spec.base_model, step_tokens=512), tid, tmp_path / "state")
             for tid in ("trainer-0", "trainer-1")}
    tokenizer = loops["trainer-0"].base.tokenizer
    core = SchedulerCore(JobTable(tmp_path / "state/jobs.sqlite"), AdaptivePolicy(), tmp_path / "state")
    ids = [r.id for r in core.submit_many(spec.submissions())]
    moves: list[Move] = []

    def tick(up: list[str]) -> None:
        with core.table.transaction():
            actions = core.plan([loops[tid].status() for tid in up])
        for action in actions:
            if isinstance(action, Start):
                loops[action.trainer].assign(assignment_for(core.table.submission(action.job), action.job, tokenizer))
            elif isinstance(action, Move):
                moves.append(action)
                loops[core.table.get(action.job).trainer].stop_job(action.job, "paused", action.reason)
        for tid in up:
            loops[tid].run_once(idle_wait=0)
            events = loops[tid].drain_events()
            with core.table.transaction():
                for event in events:
                    core.apply_event(tid, event)

    for _ in range(3):
        tick(["trainer-0"])
    assert {core.table.get(i).trainer for i in ids} == {"trainer-0"}
    for _ in range(300):
        tick(["trainer-0", "trainer-1"])
        if all(core.table.get(i).state == "completed" for i in ids):
            break
    records = [core.table.get(i) for i in ids]
    assert all(r.state == "completed" for r in records), [(r.name, r.state, r.reason) for r in records]
    assert len(moves) == 1, moves
    moved = core.table.get(moves[0].job)
    reasons = [reason for _, _, reason in core.table.transitions.of_job(moved.id)]
    assert any("then training on trainer-1, resumed from step" in r for r in reasons), reasons
    stepped = {tid: [json.loads(line)["jobs"] for line in (tmp_path / "state" / "trainers" / f"{tid}.jsonl")
                     .read_text().splitlines()] for tid in loops}
    assert any(moved.id in jobs_ for jobs_ in stepped["trainer-0"])
    assert any(moved.id in jobs_ for jobs_ in stepped["trainer-1"])
    assert all(set(jobs_) == {moved.id} for jobs_ in stepped["trainer-1"])   # nothing else moved there
    solo = run_spec(path, tmp_path / "solo", [next(j for j in jobs if j["name"] == moved.name)], step_tokens=512)
    train_locally(solo, base=load_base_model(path, dtype="float32", device="cpu"), progress=False)
    difference = max_relative_difference(adapter_tensors(tmp_path / "out" / moved.name),
                                         adapter_tensors(tmp_path / "solo" / moved.name))
    assert difference <= 1e-4, difference
