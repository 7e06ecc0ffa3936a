"""The LoRA-aware pipeline schedule, on its own (no model): its operations keep every rule a pipeline of
independent adapters needs (each job's order, its step before its next micro-batch, dropout generators in
sequence, 1F1B's in-flight bound), it leaves no stage idle once there are as many jobs as stages, it waits
for no flush, and every copy fed the same messages decides the same operations."""

from __future__ import annotations

import pytest

from actors.engine.pipeline.pipeline_schedule import MicroBatchPlan, PipelineSchedule


def drive(stages: int, jobs: int, *, steps: int = 12, accum: int = 1, dropout: bool = False, flush: bool = False,
          per_plan: int = 1, costs: list[float] | None = None) -> tuple[PipelineSchedule, list[MicroBatchPlan]]:
    """A head as the pipeline trainer's: compose when the schedule wants a plan, jobs that would not wait
    first, `per_plan` jobs per plan, until every job has `steps` optimizer steps; then drain."""
    schedule = PipelineSchedule(stages, flush=flush)
    micro = {f"j{index}": 0 for index in range(jobs)}
    plans: list[MicroBatchPlan] = []
    rotation = 0
    while True:
        assert schedule.wants_plan, "the schedule stalled"
        live = [job for job in micro if micro[job] < steps * accum]
        if not live:
            break
        ordered = live[rotation % len(live):] + live[:rotation % len(live)]
        rotation += 1
        free = [job for job in ordered if not schedule.job_waits(job)]
        chosen = (free or ordered)[:per_plan]
        closes = []
        for job in chosen:
            micro[job] += 1
            if micro[job] % accum == 0:
                closes.append(job)
        cost = costs[len(plans) % len(costs)] if costs else 1.0
        plan = MicroBatchPlan(index=len(plans), jobs=tuple(chosen), closes=tuple(closes),
                              serial=tuple(chosen) if dropout else (), cost=cost)
        plans.append(plan)
        schedule.add_plan(plan)
    schedule.drain()
    assert schedule.idle()
    return schedule, plans


def check_rules(schedule: PipelineSchedule, plans: list[MicroBatchPlan], ops: list[list]) -> None:
    stages = schedule.stages
    for stage in range(stages):
        forwards = [op.index for op in ops[stage] if op.kind in ("F", "FB")]
        backwards = [op.index for op in ops[stage] if op.kind in ("B", "FB")]
        assert forwards == sorted(forwards) == list(range(len(plans))), "forwards in plan order"
        assert backwards == sorted(backwards) == list(range(len(plans))), "backwards in plan order"
        live = 0
        for op in ops[stage]:   # 1F1B's bound on micro-batches forwarded, not backwarded
            live += {"F": 1, "B": -1}.get(op.kind, 0)
            assert live <= stages - stage
    timing = {(op.kind, op.stage, op.index): op for stage_ops in ops for op in stage_ops if op.kind in ("F", "B", "FB")}
    last = stages - 1

    def backward_end(stage: int, index: int) -> float:
        return timing[("FB" if stage == last else "B", stage, index)].end

    def forward(stage: int, index: int):
        return timing[("FB" if stage == last else "F", stage, index)]

    previous: dict[str, MicroBatchPlan] = {}
    for plan in plans:
        for job in plan.jobs:
            before = previous.get(job)
            if before is not None and job in before.closes:
                # the job's step: its closing micro-batch has left stage 0's backward before this one enters
                assert forward(0, plan.index).start >= backward_end(0, before.index)
                for stage in range(stages):   # and every stage stepped it in between, before this forward
                    sequence = ops[stage]
                    step = next(i for i, op in enumerate(sequence) if op.kind == "O" and op.job == job
                                and op.index == before.index)
                    position = sequence.index(forward(stage, plan.index))
                    done = sequence.index(timing[("FB" if stage == last else "B", stage, before.index)])
                    assert done < step < position
            if before is not None and job in plan.serial:
                assert forward(0, plan.index).start >= forward(last, before.index).end
            previous[job] = plan


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("accum,dropout", [(1, False), (2, False), (1, True)])
def test_rules_hold_and_no_stage_idles_with_as_many_jobs_as_stages(stages, accum, dropout):
    schedule, plans = drive(stages, 2 * stages, accum=accum, dropout=dropout)
    ops = [list(schedule.ops[s]) for s in range(stages)]   # drained: nothing taken yet
    check_rules(schedule, plans, ops)
    # the only idle time is filling and emptying the pipeline once: S - 1 forwards and backwards of 3 per
    # 2S jobs x 12 steps of 3 units; a flush per step would cost that again at every step
    fill = (stages - 1) * 3
    work = 2 * stages * 12 * 3
    for share in schedule.bubble_share():
        assert share <= fill / (work + fill) + 1e-9, (share, schedule.bubble_share())


@pytest.mark.parametrize("stages", [2, 4])
def test_a_flush_at_every_step_costs_a_fill_per_global_batch(stages):
    lora_aware, _ = drive(stages, 2 * stages)
    flushed, _ = drive(stages, 2 * stages, flush=True)
    fill = (stages - 1) * 3
    assert lora_aware.last_end == 2 * stages * 12 * 3 + fill
    assert flushed.last_end == 12 * (2 * stages * 3 + fill)


def test_fewer_jobs_than_stages_leave_stages_idle_but_break_no_rule():
    schedule, plans = drive(4, 2, accum=2)
    check_rules(schedule, plans, [list(schedule.ops[s]) for s in range(4)])
    assert min(schedule.bubble_share()) > 0.4   # two jobs cannot fill four stages, each waits for its step


def test_stage_zero_starts_as_many_micro_batches_as_stages_before_its_first_backward():
    """Six jobs on three stages, two per plan: three plans enter stage 0 before the first comes back."""
    schedule = PipelineSchedule(3)
    for index in range(4):
        assert schedule.wants_plan
        jobs = (f"a{index % 3}", f"b{index % 3}")
        schedule.add_plan(MicroBatchPlan(index=index, jobs=jobs, closes=jobs))
    kinds = [(op.kind, op.index) for op in schedule.take(0) if op.kind in ("F", "B")]
    assert kinds[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]


def test_every_copy_fed_the_same_messages_decides_the_same_operations():
    """A stage takes its operations after each message; the head's copy after all: the same sequence."""
    costs = [1.0, 2.5, 0.5, 1.5]
    reference, plans = drive(3, 7, accum=2, costs=costs)
    follower = PipelineSchedule(3)
    taken = [[] for _ in range(3)]
    for plan in plans:
        follower.add_plan(plan)
        for stage in range(3):
            taken[stage].extend(follower.take(stage))
    follower.drain()
    for stage in range(3):
        taken[stage].extend(follower.take(stage))
        assert taken[stage] == list(reference.ops[stage])


def test_a_removed_job_leaves_after_its_last_operations_with_its_last_step():
    schedule = PipelineSchedule(3)
    schedule.add_plan(MicroBatchPlan(index=0, jobs=("a", "b"), closes=("a", "b")))
    schedule.add_plan(MicroBatchPlan(index=1, jobs=("c",), closes=("c",)))
    schedule.remove_job("a")
    schedule.add_plan(MicroBatchPlan(index=2, jobs=("b",), closes=("b",)))
    schedule.drain()
    for stage in range(3):
        kinds = [(op.kind, op.index, op.job) for op in schedule.take(stage)]
        leave = kinds.index(("X", -1, "a"))
        assert ("O", 0, "a") in kinds[:leave]   # its last step first
        last_of_a = max(i for i, (kind, index, _) in enumerate(kinds) if index == 0 and kind in ("F", "B", "FB"))
        assert last_of_a < leave


def test_plans_out_of_order_or_empty_are_refused():
    schedule = PipelineSchedule(2)
    with pytest.raises(ValueError, match="out of order"):
        schedule.add_plan(MicroBatchPlan(index=1, jobs=("a",)))
    with pytest.raises(ValueError, match="no job"):
        schedule.add_plan(MicroBatchPlan(index=0, jobs=()))
