"""The scheduling simulator: hand-computed schedules on a tiny trace, OOMs counted where true peaks exceed
a budget, a calibration that recovers known step costs from a step log, and the shipped traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.simulator.sim_calibration import calibrate
from orchestrator.simulator.sim_replay import Simulator
from orchestrator.simulator.sim_trace import Trace, load_trace
from orchestrator.simulator.simulate import main
from policies.ordering import AdaptivePolicy
from policies.registry import load_policy

TRACES = Path(__file__).resolve().parents[3] / "policies" / "traces"


def one_at_a_time(**calibration) -> Trace:
    """One trainer that runs one job at a time; every step takes 1 s; jobs start at once."""
    job = {"batch_size": 1, "lengths": {"mean": 10, "std": 0, "min": 10, "max": 10}}
    return Trace.model_validate({
        "trainers": [{"memory_budget_bytes": 10**12, "max_jobs": 1}],
        "calibration": {"step": {"constant": 1.0, "per_token": 0.0}, "job_start_seconds": 0.0,
                        "checkpoint_seconds": 0.0, **calibration},
        "jobs": [{"name": "a", "arrival": 0.0, "steps": 10, **job},
                 {"name": "c", "arrival": 0.1, "steps": 5, **job},
                 {"name": "b", "arrival": 0.2, "steps": 2, **job}]})


def finishes(trace: Trace, policy) -> dict[str, float]:
    sim = Simulator(trace, policy)
    sim.run()
    return {name: job.finish for name, job in sim.jobs.items()}


def test_fifo_and_sjf_run_the_queue_in_their_orders():
    trace = one_at_a_time()
    assert finishes(trace, load_policy("fifo")) == {"a": 10.0, "c": 15.0, "b": 17.0}
    assert finishes(trace, load_policy("sjf")) == {"a": 10.0, "b": 12.0, "c": 17.0}
    result = Simulator(trace, load_policy("fifo")).run()
    assert result.makespan == 17.0 and result.ooms == 0
    assert result.turnaround == pytest.approx([10.0, 14.9, 16.8])


def test_adaptive_preempts_a_long_job_for_a_much_shorter_one():
    # b (2 steps) arrives while a has ~10 left: more than 4x as much, so a pauses at its next step boundary
    done = finishes(one_at_a_time(), AdaptivePolicy(preempt_ratio=4.0))
    assert done["b"] == 3.0            # a's first step, then b's two
    assert done["c"] == 8.0            # c (5) before a (9 left)
    assert done["a"] == 17.0           # nothing lost: a's 10 steps in all
    assert finishes(one_at_a_time(), AdaptivePolicy(preempt_ratio=100.0))["b"] == 12.0   # not worth it


def test_true_peaks_over_the_budget_count_as_ooms():
    trace = Trace.model_validate({
        "trainers": [{"memory_budget_bytes": 1_000_000, "step_tokens": 450}], "parameters_per_rank": 1,
        "calibration": {"memory": {"constant": 500_000, "per_token": 1000.0, "per_parameter": 0.0},
                        "memory_noise": 0.5, "job_start_seconds": 0.0},
        "jobs": [{"name": "a", "steps": 20, "batch_size": 1, "lengths": {"mean": 450, "std": 0, "max": 512}}]})
    # predicted 950 kB fits, but true peaks vary by up to +50%: some steps do not
    assert Simulator(trace, load_policy("fifo")).run().ooms > 0
    exact = trace.model_copy(update={"calibration": trace.calibration.model_copy(update={"memory_noise": 0.0})})
    assert Simulator(exact, load_policy("fifo")).run().ooms == 0


def test_calibration_recovers_step_costs_from_a_step_log(tmp_path):
    rows = []
    for i in range(40):
        lengths = [16 + (i * 7) % 50] * (1 + i % 5)
        tokens = sum(lengths)
        squares = sum(n * n for n in lengths)
        rows.append({"step": i + 1, "jobs": ["j"], "tokens": tokens, "padding_tokens": 0, "time": 1000.0 + i,
                     "seconds": 0.2 + 0.003 * tokens + 1e-5 * squares, "sequence_lengths": lengths,
                     "peak_memory_bytes": 10**9 + 5000 * tokens + 100 * squares + 16 * 1000,
                     "adapter_parameters": 1000})
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "trainer-0.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    calibration = calibrate(tmp_path)
    assert calibration.step.constant == pytest.approx(0.2, rel=1e-3)
    assert calibration.step.per_token == pytest.approx(0.003, rel=1e-3)
    assert calibration.step.per_square == pytest.approx(1e-5, rel=1e-3)
    assert calibration.memory.per_token == pytest.approx(5000, rel=0.02)


def test_calibrating_from_a_damaged_job_table_says_which_file_and_what_to_do(tmp_path, capsys):
    (tmp_path / "trainers").mkdir()
    (tmp_path / "trainers" / "trainer-0.jsonl").write_text("".join(json.dumps(
        {"step": i, "jobs": ["j"], "tokens": 10 * i, "padding_tokens": 0, "time": 1000.0 + i, "seconds": 0.1 * i,
         "sequence_lengths": [10] * i, "peak_memory_bytes": 10**6 * i, "adapter_parameters": 10}) + "\n"
        for i in range(1, 9)))
    table = tmp_path / "jobs.sqlite"
    table.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 16)   # a header, then garbage: damaged
    assert main([str(TRACES / "burst.yaml"), "--calibrate", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"cannot read job start times from {table}" in err and "jobs.sqlite.backup" in err


def test_adaptive_beats_fifo_on_the_steady_trace_with_no_oom(capsys):
    trace = load_trace(TRACES / "steady.yaml")
    fifo, adaptive = (Simulator(trace, load_policy(name)).run() for name in ("fifo", "adaptive"))
    mean = lambda r: sum(r.turnaround) / len(r.turnaround)   # noqa: E731 - a one-line measure used twice below
    assert mean(adaptive) <= 0.70 * mean(fifo)
    assert adaptive.ooms == fifo.ooms == 0
    assert main([str(TRACES / "burst.yaml"), "--policies", "fifo,adaptive"]) == 0
    out = capsys.readouterr().out
    assert "adaptive" in out and "fifo" in out and "1.00x" in out


def test_a_bad_trace_names_the_file_and_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainers: [{memory_budget_bytes: 1}]\njobs: [{name: a, steps: 0, lengths: {mean: 5}}]\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "steps" in err


def three_jobs_two_trainers(steps: int) -> Trace:
    """Two equal trainers, three equal jobs at once; a job's micro-batch costs 1 s, fused steps add up."""
    job = {"batch_size": 1, "steps": steps, "lengths": {"mean": 10, "std": 0, "min": 10, "max": 10}}
    return Trace.model_validate({
        "trainers": [{"id": "t0", "memory_budget_bytes": 10**12}, {"id": "t1", "memory_budget_bytes": 10**12}],
        "calibration": {"step": {"constant": 0.0, "per_token": 0.1}, "job_start_seconds": 0.0,
                        "checkpoint_seconds": 0.0},
        "jobs": [{"name": name, **job} for name in ("a", "b", "c")]})


def test_moving_a_job_to_the_idle_trainer_shortens_the_makespan():
    from orchestrator.simulator.simulate import without_moves
    from policies.moves import MoveRule

    trace = three_jobs_two_trainers(100)
    # placed 2 + 1 (least queued tokens, then trainer id): t0 steps a and c fused (2 s a step) until 200 s,
    # t1 runs b alone (1 s a step) and idles from 100 s
    still = Simulator(trace, AdaptivePolicy(moves=None))
    plain = still.run()
    assert plain.makespan == pytest.approx(200.0) and plain.moves == 0
    assert {n: j.finish for n, j in still.jobs.items()} == pytest.approx({"a": 200.0, "b": 100.0, "c": 200.0})
    moving = Simulator(trace, AdaptivePolicy())
    result = moving.run()
    # by hand: at time x t0 holds 2000 - 10x queued tokens, t1 1000 - 10x; the move's cost is the larger of
    # 10 steps of 20 tokens and 30 s at t1's 10 tokens/s: 300 tokens; moving one of t0's jobs gives
    # max(1000 - 5x, 2300 - 15x), worth it once <= 0.8 (2000 - 10x): x >= 100, when b ends: a (50 steps
    # done) moves to the idle t1 and ends with c at 150 s, the best any schedule does
    assert result.moves == 1 and all(j.moves <= 1 for j in moving.jobs.values())
    assert result.makespan == pytest.approx(150.0)
    assert {n: j.finish for n, j in moving.jobs.items()} == pytest.approx({"a": 150.0, "b": 100.0, "c": 150.0})
    # a cheaper move (no time cost) pays off earlier: at t0's step boundary at 86 s (x >= 85.7 with 200
    # tokens), a (43 steps done) joins b (14 left) on t1: fused until 114 s, then alone to 157 s
    cheap = Simulator(trace, AdaptivePolicy(moves=MoveRule(cost_s=0.0)))
    assert cheap.run().makespan == pytest.approx(157.0)
    assert {n: j.finish for n, j in cheap.jobs.items()} == pytest.approx({"a": 157.0, "b": 114.0, "c": 143.0})
    assert result.steps == plain.steps == 300 and result.ooms == 0     # nothing lost or repeated
    assert without_moves(load_policy("fifo")) is None                 # fifo never moves
    # too short to pay for a move: no move, the same schedule
    short = three_jobs_two_trainers(10)
    assert Simulator(short, AdaptivePolicy()).run().moves == 0


def test_the_uneven_trace_gains_from_moves(capsys):
    trace = load_trace(TRACES / "uneven.yaml")
    assert main([str(TRACES / "uneven.yaml"), "--policies", "fifo,adaptive", "--without-moves"]) == 0
    out = capsys.readouterr().out
    assert "adaptive-nomoves" in out
    with_moves = Simulator(trace, load_policy("adaptive")).run()
    from orchestrator.simulator.simulate import without_moves
    plain = Simulator(trace, without_moves(load_policy("adaptive"))).run()
    assert with_moves.moves > 0 and with_moves.makespan < plain.makespan


def pipeline_trace(stages: int, transfer: float = 0.0) -> Trace:
    """8 jobs of 12 steps, one 100-token sequence each, on one trainer: a fused step costs 1 ms a token."""
    job = {"batch_size": 1, "steps": 12, "arrival": 0.0, "lengths": {"mean": 100, "std": 0, "min": 100, "max": 100}}
    return Trace.model_validate({
        "trainers": [{"memory_budget_bytes": 10**12, "step_tokens": 10_000, "stages": stages,
                      "transfer_seconds": transfer}],
        "calibration": {"step": {"constant": 0.0, "per_token": 0.001}, "job_start_seconds": 0.0,
                        "checkpoint_seconds": 0.0},
        "jobs": [{"name": f"j{index}", **job} for index in range(8)]})


def test_a_pipeline_trainer_runs_the_same_work_stages_times_faster_plus_one_fill():
    """One device: 12 fused steps of all 8 jobs, 0.8 s each: 9.6 s. Four stages: 48 micro-batches of 2 jobs
    (ceil(8 / 4)), each stage 1/4 of a 0.2 s step (forward and backward) = 0.05 s, back to back once the
    pipeline is full, plus filling it once (3 stages x 0.05 s): 2.55 s at best; at most one micro-batch's round
    trip through the stages more (0.2 s: at the end fewer jobs than stages are left, each waiting for its own
    step); a flush per step would cost a fill per step (12 x 0.15 s)."""
    single = Simulator(pipeline_trace(1), load_policy("fifo")).run()
    assert single.makespan == pytest.approx(9.6)
    piped = Simulator(pipeline_trace(4), load_policy("fifo")).run()
    assert 9.6 / 4 + 3 * 0.05 - 1e-9 <= piped.makespan <= 9.6 / 4 + 3 * 0.05 + 0.2
    assert piped.steps == single.steps == 8 * 12 and piped.tokens == single.tokens


@pytest.mark.parametrize("stages", [4, 8, 16])
def test_every_policy_schedules_onto_pipeline_trainers_and_transfers_cost_time(stages):
    for policy in ("fifo", "sjf", "adaptive"):
        quick = Simulator(pipeline_trace(stages), load_policy(policy)).run()
        slow = Simulator(pipeline_trace(stages, transfer=0.01), load_policy(policy)).run()
        assert quick.steps == slow.steps == 8 * 12
        assert slow.makespan > quick.makespan


def test_users_token_shares_follow_their_weights():
    """Two users with shares 1 and 3, each with more jobs than the trainer holds at once, all submitted at the
    start (the first user's first): over the run, each user's trained tokens per window follow the weights
    within 10% once both have jobs running (the first windows are the start's)."""
    job = {"batch_size": 1, "steps": 20, "lengths": {"mean": 10, "std": 0, "min": 10, "max": 10}}
    trace = Trace.model_validate({
        "trainers": [{"memory_budget_bytes": 10**12, "max_jobs": 4}], "users": {"light": 1.0, "heavy": 3.0},
        "fair_share_window_s": 10_000.0,
        "calibration": {"step": {"constant": 1.0, "per_token": 0.0}, "job_start_seconds": 0.0,
                        "checkpoint_seconds": 0.0},
        "jobs": [{"name": f"light-{i}", "arrival": 0.0, "user": "light", **job} for i in range(30)]
                + [{"name": f"heavy-{i}", "arrival": 0.01, "user": "heavy", **job} for i in range(90)]})
    for policy in ("fifo", "adaptive"):
        result = Simulator(trace, load_policy(policy)).run()
        busy_until = min(max(t for t, u, _ in result.trained if u == user) for user in ("light", "heavy"))
        for window_end in (busy_until / 2, busy_until):   # cumulative share at half-time and at the end
            tokens = {user: sum(n for t, u, n in result.trained if u == user and t <= window_end)
                      for user in ("light", "heavy")}
            heavy = tokens["heavy"] / (tokens["light"] + tokens["heavy"])
            assert abs(heavy - 0.75) <= 0.075, (policy, window_end, tokens)
    with pytest.raises(ValueError, match="users .'nobody'. that `users` does not list"):
        Trace.model_validate({**trace.model_dump(), "jobs": [{"name": "x", "user": "nobody", **job}]})
