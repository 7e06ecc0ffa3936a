"""Each built-in policy's decisions on hand-built snapshots, and finding policies by name,
`module:Class` and entry point."""

from __future__ import annotations

import itertools

import pytest

from policies.base import JobView, Preempt, Snapshot, Start, TrainerView, Wait
from policies.fifo import FifoPolicy
from policies.ordering import AdaptivePolicy, PriorityPolicy, SjfPolicy
from policies.registry import load_policy

MiB = 2**20


def trainer(tid="t0", model="m", budget=1000 * MiB, base=400 * MiB, step=200 * MiB) -> TrainerView:
    return TrainerView(id=tid, base_model=model, quantization="none", memory_budget_bytes=budget, base_bytes=base,
                       step_memory_bytes=step, jobs=(), linear_shapes=())


def job(jid, *, state="queued", priority=0, submitted=0.0, model="m", trainer=None, step=0, total=100,
        memory=100 * MiB, tokens_per_step=100.0, preempting=False) -> JobView:
    return JobView(id=jid, name=jid, state=state, priority=priority, submitted_at=submitted, base_model=model,
                   quantization="none", trainer=trainer, step=step, total_steps=total, memory_bytes=memory,
                   tokens_per_step=tokens_per_step, predicted_remaining_steps=None, preempting=preempting)


def snapshot(trainers, jobs, now=0.0) -> Snapshot:
    return Snapshot(now, tuple(trainers), tuple(jobs))


def test_fifo_starts_in_submission_order_within_the_budget_and_explains_the_rest():
    jobs = [job("late", submitted=5), job("early", submitted=1), job("mid", submitted=3),
            job("other-model", submitted=0, model="x"), job("huge", submitted=9, memory=900 * MiB)]
    decisions = FifoPolicy().decide(snapshot([trainer()], jobs))
    assert decisions[0] == Wait("other-model", decisions[0].reason, "no_trainer")
    assert "no trainer holds" in decisions[0].reason
    assert decisions[1:4] == [Start("early", "t0"), Start("mid", "t0"), Start("late", "t0")]
    assert isinstance(decisions[4],
                      Wait) and decisions[4].cause == "memory" and "waiting for memory" in decisions[4].reason


def test_a_budget_for_two_jobs_never_starts_a_third():
    """Each policy keeps the third job waiting for memory (and says so), and starts it once the budget holds
    three: a policy that decided nothing, or refused everything, fails here."""
    running = [job("a", state="running", trainer="t0"), job("b", state="running", trainer="t0")]
    tight = trainer(budget=400 * MiB + 200 * MiB + 250 * MiB)   # base + step + 2.5 jobs
    roomy = trainer(budget=400 * MiB + 200 * MiB + 300 * MiB)   # base + step + 3 jobs
    for policy in (FifoPolicy(), SjfPolicy(), PriorityPolicy(), AdaptivePolicy()):
        decisions = policy.decide(snapshot([tight], running + [job("c", priority=0)]))
        assert not any(isinstance(d, Start) for d in decisions), policy.name
        waits = [d for d in decisions if isinstance(d, Wait) and d.job == "c"]
        assert len(waits) == 1 and waits[0].cause == "memory", (policy.name, decisions)
        decisions = policy.decide(snapshot([roomy], running + [job("c", priority=0)]))
        assert Start("c", "t0") in decisions, (policy.name, decisions)


def test_sjf_starts_the_shortest_remaining_work_first():
    jobs = [job("long", submitted=0, total=1000), job("short", submitted=1, total=10),
            job("started-long", submitted=2, total=500, step=490)]
    t = trainer(budget=400 * MiB + 200 * MiB + 200 * MiB)   # room for two
    decisions = SjfPolicy().decide(snapshot([t], jobs))
    assert decisions[:2] == [Start("short", "t0"), Start("started-long", "t0")]
    assert isinstance(decisions[2], Wait)


def test_priority_preempts_the_lowest_priority_job_to_make_room():
    running = [job("low", state="running", trainer="t0", priority=0, step=10),
               job("mid", state="running", trainer="t0", priority=1, step=10)]
    t = trainer(budget=400 * MiB + 200 * MiB + 200 * MiB)   # full with two
    decisions = PriorityPolicy().decide(snapshot([t], running + [job("urgent", priority=5)]))
    assert [d for d in decisions if isinstance(d, Preempt)] == [Preempt("low", decisions[0].reason)]
    assert isinstance(decisions[-1], Wait) and decisions[-1].cause == "priority" and "to pause" in decisions[-1].reason
    # while "low" is pausing, nothing more is preempted
    running[0] = job("low", state="running", trainer="t0", priority=0, preempting=True)
    decisions = PriorityPolicy().decide(snapshot([t], running + [job("urgent", priority=5)]))
    assert not any(isinstance(d, Preempt) for d in decisions)
    # an equal priority never preempts
    decisions = PriorityPolicy().decide(snapshot([t], running[1:] + [job("mid2", state="running", trainer="t0",
                                                                         priority=1), job("peer", priority=1)]))
    assert not any(isinstance(d, Preempt) for d in decisions)


def test_adaptive_orders_by_weighted_remaining_work_and_ages_waiting_jobs():
    jobs = [job("long-high", priority=1, total=1000, submitted=100), job("short-high", priority=1, total=5,
                                                                         submitted=100),
            job("short-low", priority=0, total=5, submitted=100)]
    t = trainer(budget=400 * MiB + 200 * MiB + 100 * MiB)   # room for one
    decisions = AdaptivePolicy().decide(snapshot([t], jobs, now=100))
    assert decisions[0] == Start("short-high", "t0")
    # after waiting long enough, the low-priority job goes first
    aged = [job("short-low", priority=0, total=5, submitted=-1000),
            job("short-high", priority=1, total=5, submitted=1000)]
    decisions = AdaptivePolicy(aging_s=600).decide(snapshot([t], aged, now=1300))
    assert decisions[0] == Start("short-low", "t0")


def test_policies_are_found_by_name_module_and_entry_point():
    assert load_policy("adaptive").name == "adaptive"
    assert load_policy("policies.ordering:SjfPolicy").name == "sjf"
    plugin = load_policy("fixed-concurrency")        # examples/policy-plugin, installed by `make setup`
    assert type(plugin).__module__ == "aspen_example_policy"
    with pytest.raises(ValueError, match="unknown policy 'nope'.*fixed-concurrency"):
        load_policy("nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_policy("policies.ordering:Missing")


def test_max_jobs_caps_a_trainer_and_priority_preempts_for_a_slot():
    t = TrainerView(id="t0", base_model="m", quantization="none", memory_budget_bytes=10_000 * MiB,
                    base_bytes=400 * MiB, step_memory_bytes=200 * MiB, jobs=(), linear_shapes=(), max_jobs=2)
    running = [job("a", state="running", trainer="t0", step=50), job("b", state="running", trainer="t0", step=5)]
    decisions = FifoPolicy().decide(snapshot([t], running + [job("c")]))
    assert isinstance(decisions[0], Wait) and decisions[0].cause == "slots" and "max_jobs" in decisions[0].reason
    decisions = PriorityPolicy().decide(snapshot([t], running + [job("urgent", priority=3)]))
    assert [d.job for d in decisions if isinstance(d, Preempt)] == ["b"]      # the one with least progress


def padded_fused_cost(chosen) -> int:
    """mLoRA's layout: every row padded to the step's longest sequence."""
    longest = max(max(b.lengths) for b in chosen)
    return longest * sum(len(b.lengths) for b in chosen)


def test_minpad_puts_jobs_of_similar_length_together_and_starves_none():
    from policies.base import NextBatch, StepComposer
    from policies.minpad import MinPadPolicy

    policy = load_policy("minpad")
    assert isinstance(policy, MinPadPolicy) and isinstance(policy, StepComposer)
    lengths = {"a": (10, 12), "b": (11, 9), "c": (100, 98), "d": (95, 100), "e": (12, 100)}
    waited = dict.fromkeys(lengths, 0)
    joined = {name: [] for name in lengths}
    for step in range(20):
        batches = [NextBatch(name, lengths[name], waited[name]) for name in lengths]
        chosen = policy.compose_step(batches, padded_fused_cost, 10_000, lambda chosen: True)
        for name in lengths:
            waited[name] = 0 if name in chosen else waited[name] + 1
            if name in chosen:
                joined[name].append(step)
        if {"a", "b"} & set(chosen):
            assert not {"c", "d"} & set(chosen), chosen   # short rows never padded to 100
    for name, steps in joined.items():   # nobody waits longer than there are jobs
        gaps = [b - a for a, b in itertools.pairwise([-1, *steps])]
        assert steps and max(gaps) <= len(lengths), (name, steps)


def test_minpad_respects_the_token_and_memory_budgets():
    from policies.base import NextBatch
    from policies.minpad import MinPadPolicy

    batches = [NextBatch(f"j{i}", (50, 50), waited=0 if i else 3) for i in range(14)]   # greedy beyond 10
    chosen = MinPadPolicy().compose_step(batches, padded_fused_cost, 400, lambda chosen: True)
    assert chosen[0] == "j0" and len(chosen) == 4      # 4 jobs x 2 rows x 50 tokens = 400
    chosen = MinPadPolicy().compose_step(batches, padded_fused_cost, 400, lambda chosen: len(chosen) <= 2)
    assert len(chosen) == 2


def test_adaptive_weighs_a_priority_level_as_four_times_the_work_and_preempts_where_worth_it():
    t = trainer(budget=400 * MiB + 200 * MiB + 100 * MiB)   # room for one
    # a level higher but 8x the work: the short low-priority job goes first
    decisions = AdaptivePolicy().decide(snapshot([t], [job("big-high", priority=1, total=80), job("small", total=10)]))
    assert decisions[0] == Start("small", "t0")
    # a running job with 5x the work of a newcomer of its priority is paused for it; with 2x it is not
    running = job("long", state="running", trainer="t0", total=50)
    decisions = AdaptivePolicy().decide(snapshot([t], [running, job("short", total=10)]))
    assert isinstance(decisions[0], Preempt) and decisions[0].job == "long"
    decisions = AdaptivePolicy().decide(snapshot([t], [running, job("half", total=25)]))
    assert not any(isinstance(d, Preempt) for d in decisions)


# -- placement over several trainers, and moves ---------------------------------------------------------------

def built_in_policies():
    from policies.registry import builtin_policies

    return [cls() for cls in builtin_policies().values()]


def placements(decisions) -> dict[str, list[str]]:
    placed: dict[str, list[str]] = {}
    for d in decisions:
        if isinstance(d, Start):
            placed.setdefault(d.trainer, []).append(d.job)
    return placed


def test_every_policy_spreads_small_jobs_over_idle_trainers():
    # the reported bug: 4 small jobs, 2 idle CPU trainers with room for all of them: all went to the one
    # with the most free memory (each trainer's step memory is its own probe's measurement: they differ by
    # more than a few small adapters)
    trainers = [trainer("t0", step=150 * MiB), trainer("t1")]
    jobs = [job(f"j{i}", memory=10 * MiB, submitted=float(i)) for i in range(4)]
    for policy in built_in_policies():
        placed = placements(policy.decide(snapshot(trainers, jobs)))
        assert sorted(len(v) for v in placed.values()) == [2, 2], (policy.name, placed)


def test_placement_goes_by_queued_step_tokens_then_free_memory():
    # t0 already runs a long job: the newcomers go to t1 until its queued tokens pass t0's
    trainers = [trainer("t0"), trainer("t1", budget=2000 * MiB)]
    running = job("long", state="running", trainer="t0", total=1000, memory=10 * MiB)    # 100k tokens left
    small = [job(f"s{i}", total=100, memory=10 * MiB, submitted=float(i)) for i in range(3)]   # 10k each
    for policy in built_in_policies():
        assert placements(policy.decide(snapshot(trainers, [running, *small])))  == {"t1": ["s0", "s1", "s2"]}, \
            policy.name
    # equal load: the trainer with more free memory, then the lower id
    assert FifoPolicy().decide(snapshot(trainers, [small[0]])) == [Start("s0", "t1")]
    assert FifoPolicy().decide(snapshot([trainer("t1"), trainer("t0")], [small[0]])) == [Start("s0", "t0")]


def test_a_nodes_job_processes_cap_its_running_jobs_and_the_rest_wait_for_host_memory():
    """Each running job has a process (its job actor) on its trainer's node: a node holds at most its
    job_slots of them, counted over all its trainers, those running already included; jobs beyond wait
    queued (cause `host`, naming the setting); a node without a limit takes the rest."""
    from dataclasses import replace

    small = 5 * MiB   # memory and step slots would let every job run: only the host limit holds them back
    one = [replace(trainer("t0"), node="n1"), replace(trainer("t1"), node="n1")]
    running = job("r0", state="running", trainer="t0", memory=small)
    queued = [job(f"q{i}", memory=small, submitted=float(i)) for i in range(5)]
    for policy in built_in_policies():
        decisions = policy.decide(Snapshot(0.0, tuple(one), (running, *queued), job_slots={"n1": 3}))
        started = [d.job for d in decisions if isinstance(d, Start)]
        waits = [d for d in decisions if isinstance(d, Wait)]
        assert len(started) == 2, (policy.name, decisions)                  # 1 running + 2 = the node's 3
        assert {d.job for d in waits} == {q.id for q in queued} - set(started), (policy.name, decisions)
        assert all(d.cause == "host" and "job_processes_per_node" in d.reason for d in waits), waits
        other = [*one, replace(trainer("t2"), node="n2")]                   # another node, no limit there
        decisions = policy.decide(Snapshot(0.0, tuple(other), (running, *queued), job_slots={"n1": 3}))
        placed = placements(decisions)
        assert len(placed.get("t0", [])) + len(placed.get("t1", [])) <= 2 and sum(map(len, placed.values())) == 5, \
            (policy.name, placed)


def test_a_big_job_goes_where_it_fits_and_a_job_only_to_its_base_model():
    small_t = trainer("small", budget=400 * MiB + 200 * MiB + 50 * MiB)
    big_t = trainer("big", budget=400 * MiB + 200 * MiB + 500 * MiB)
    busy = job("busy", state="running", trainer="big", total=10_000, memory=10 * MiB)   # big is loaded
    decisions = FifoPolicy().decide(snapshot([small_t, big_t], [busy, job("huge", memory=300 * MiB)]))
    assert decisions == [Start("huge", "big")]       # more loaded, but the only one it fits
    other = trainer("other", model="x")
    jobs = [job(f"m{i}", submitted=float(i), memory=10 * MiB) for i in range(2)] + [job("x1", model="x", submitted=5)]
    placed = placements(FifoPolicy().decide(snapshot([trainer("t0"), other, trainer("t1")], jobs)))
    assert placed == {"t0": ["m0"], "t1": ["m1"], "other": ["x1"]}


def on(tid, *jobs_here) -> TrainerView:
    return TrainerView(id=tid, base_model="m", quantization="none", memory_budget_bytes=10_000 * MiB,
                       base_bytes=400 * MiB, step_memory_bytes=200 * MiB, jobs=tuple(jobs_here), linear_shapes=())


def test_adaptive_moves_a_job_to_an_idle_trainer_with_hysteresis():
    from policies.base import Move

    # t0 runs three long jobs; t1 has nothing: one moves (the estimate for the pair: 300k tokens -> 200k)
    running = [job(f"r{i}", state="running", trainer="t0", total=1000, memory=10 * MiB) for i in range(3)]
    trainers = [on("t0", "r0", "r1", "r2"), on("t1")]
    decisions = AdaptivePolicy().decide(snapshot(trainers, running, now=5000.0))
    moves = [d for d in decisions if isinstance(d, Move)]
    assert len(moves) == 1 and moves[0].trainer == "t1" and moves[0].job in {"r0", "r1", "r2"}
    # a slow reload on a fast trainer: 30 s (cost_s) at t1's measured 10k tokens/s outweighs the gain
    fast = [on("t0", "r0", "r1", "r2"), replace_trainer(on("t1"), tokens_per_s=10_000.0)]
    assert not any(isinstance(d, Move) for d in AdaptivePolicy().decide(snapshot(fast, running, now=5000.0)))
    assert any(isinstance(d, Move) for d in AdaptivePolicy().decide(
        snapshot([on("t0", "r0", "r1", "r2"), replace_trainer(on("t1"), tokens_per_s=1000.0)], running, now=5000.0)))
    # no clear gain once the move's cost counts: a job with a little work left on a balanced pair stays
    balanced = [job("a", state="running", trainer="t0", total=100, step=90), job("b", state="running", trainer="t0",
                total=100, step=95), job("c", state="running", trainer="t1", total=100, step=88)]
    decisions = AdaptivePolicy().decide(snapshot([on("t0", "a", "b"), on("t1", "c")], balanced, now=5000.0))
    assert not any(isinstance(d, Move) for d in decisions)
    # a job moved recently, or pausing, or still on its way to its trainer, is not moved (again)
    recent = [replace_job(j, moved_at=4900.0) for j in running]
    assert not any(isinstance(d, Move) for d in AdaptivePolicy().decide(snapshot(trainers, recent, now=5000.0)))
    assert any(isinstance(d, Move) for d in AdaptivePolicy().decide(snapshot(trainers, recent, now=5600.0)))
    arriving = [on("t0"), on("t1")]
    assert not any(isinstance(d, Move) for d in AdaptivePolicy().decide(snapshot(arriving, running, now=5000.0)))
    # a job being moved holds its room and work on the target: nothing else moves there, nothing queued fits
    moving = [replace_job(running[0], preempting=True, moving_to="t1"), *running[1:]]
    decisions = AdaptivePolicy().decide(snapshot(trainers, moving, now=5000.0))
    assert not any(isinstance(d, Move) for d in decisions)
    # never without moves enabled, nor in the policies that do not move
    assert not any(isinstance(d, Move) for d in AdaptivePolicy(moves=None).decide(snapshot(trainers, running)))
    for policy in (FifoPolicy(), SjfPolicy(), PriorityPolicy()):
        assert not any(isinstance(d, Move) for d in policy.decide(snapshot(trainers, running)))


def test_a_move_leaves_room_for_a_queued_job_first():
    from policies.base import Move

    running = [job(f"r{i}", state="running", trainer="t0", total=1000, memory=10 * MiB) for i in range(3)]
    trainers = [on("t0", "r0", "r1", "r2"), on("t1")]
    decisions = AdaptivePolicy().decide(snapshot(trainers, running + [job("new", total=2000, memory=10 * MiB)]))
    assert Start("new", "t1") in decisions            # the idle trainer takes the queued job
    assert not any(isinstance(d, Move) for d in decisions)   # and then t1 is no less loaded: no move


def replace_job(view: JobView, **changes) -> JobView:
    from dataclasses import replace

    return replace(view, **changes)


def replace_trainer(view: TrainerView, **changes) -> TrainerView:
    from dataclasses import replace

    return replace(view, **changes)


def user_job(jid, user, **kwargs) -> JobView:
    from dataclasses import replace

    return replace(job(jid, **kwargs), user=user)


@pytest.mark.parametrize("name", ["fifo", "sjf", "priority", "adaptive", "minpad"])
def test_every_built_in_policy_serves_the_least_served_user_first_and_keeps_quotas(name):
    from policies.base import UserShare

    one_slot = TrainerView(id="t0", base_model="m", quantization="none", memory_budget_bytes=1000 * MiB,
                           base_bytes=400 * MiB, step_memory_bytes=200 * MiB, jobs=(), linear_shapes=(), max_jobs=1)
    # a's twenty jobs came first, b's one afterwards: b has trained least per unit of share, so b's job takes the
    # free slot (the policy's own order holds within a user)
    jobs = [user_job(f"a{i}", "a", submitted=float(i)) for i in range(20)] + [user_job("b0", "b", submitted=30.0)]
    users = {"a": UserShare(share=1.0, trained_tokens=1000.0), "b": UserShare(share=1.0, trained_tokens=200.0)}
    decisions = load_policy(name).decide(Snapshot(0.0, (one_slot,), tuple(jobs), users=users))
    assert [d for d in decisions if isinstance(d, Start)] == [Start("b0", "t0")]
    # shares weigh the tokens: a with share 10 has trained 100 per unit, b 200: a's job first
    weighted = {"a": UserShare(share=10.0, trained_tokens=1000.0), "b": UserShare(share=1.0, trained_tokens=200.0)}
    decisions = load_policy(name).decide(Snapshot(0.0, (one_slot,), tuple(jobs), users=weighted))
    assert [d.job for d in decisions if isinstance(d, Start)] == ["a0"]
    # quotas: b may run one job at once (one runs), a has spent its tokens of the day: both wait, cause quota
    quota = {"a": UserShare(tokens_per_day=500, tokens_today=600.0),
             "b": UserShare(max_running=1)}
    running = user_job("b-running", "b", state="running", trainer="t0")
    decisions = load_policy(name).decide(Snapshot(0.0, (trainer(),), (*jobs[:2], jobs[-1], running), users=quota))
    waits = {d.job: d for d in decisions if isinstance(d, Wait)}
    assert not [d for d in decisions if isinstance(d, Start)]
    assert waits["b0"].cause == "quota" and "quota is 1 running at once" in waits["b0"].reason
    assert waits["a0"].cause == "quota" and "daily token quota (500)" in waits["a0"].reason
