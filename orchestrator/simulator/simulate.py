"""Replay a job trace against scheduling policies, fast, without a model: `python -m
orchestrator.simulator.simulate TRACE`.

A trace (YAML or JSON) names the trainers (memory budget, tokens per step), a calibration (what a fused
step costs in seconds and in memory, how long a job takes to start) and the jobs: arrival time, size
(optimizer steps), micro-batch shape and sequence lengths, priority, adapter rank, and the shape of the
job's loss curve, from which its evaluations are drawn so that the real stop rule
(`policies.stopping.PredictiveRule`) can end it early. Each policy (the real classes, by name) then
schedules the same jobs with the same data, the trainers step like the real one (round-robin within
`step_tokens` and the memory budget, or the policy's own step composer), and the simulator prints per
policy: mean and p95 turnaround, mean waiting time, makespan, throughput, moves and OOM count. A `Move` is
carried out like the service does: the job leaves its trainer at its next step boundary with a checkpoint
(`checkpoint_seconds`) and starts on the target after `job_start_seconds`. `--without-moves` also runs
each policy that moves jobs with its moves turned off (named `<policy>-nomoves`), to see what they gain.

The calibration comes from a real run: `--calibrate STATE_DIR` (a service's state folder, or any folder
with `trainers/*.jsonl` step logs and optionally `jobs.sqlite`) fits

    step seconds ≈ a + b·T + c·ΣL²          peak bytes ≈ β0 + β1·T + β2·ΣL² + β3·P

to the logged steps (T: tokens in the step, L: sequence lengths, P: adapter parameters on the trainer),
and the job start-up time to the job table (first step minus start)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orchestrator.simulator.sim_calibration import calibrate
from orchestrator.simulator.sim_replay import Simulator
from orchestrator.simulator.sim_report import Result, table
from orchestrator.simulator.sim_trace import Trace, load_trace
from policies.base import Policy
from policies.registry import load_policy

DEFAULT_POLICIES = ("fifo", "sjf", "priority", "adaptive")


def without_moves(policy: Policy) -> Policy | None:
    """A copy of a policy that moves jobs (a `moves` attribute, e.g. `adaptive`) with moves off; None for
    one that does not move jobs."""
    if getattr(policy, "moves", None) is None:
        return None
    copy = type(policy).__new__(type(policy))
    copy.__dict__.update(policy.__dict__, moves=None, name=f"{policy.name}-nomoves")
    return copy


def simulate(trace: Trace, policies: list[str], compare_moves: bool = False) -> list[Result]:
    results = []
    for name in policies:
        policy = load_policy(name)
        results.append(Simulator(trace, policy).run())
        still = without_moves(policy) if compare_moves else None
        if still is not None:
            results.append(Simulator(trace, still).run())
    return results


# -- the command -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.simulator.simulate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="trace file (YAML or JSON); examples in policies/traces/")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated policy names (default: {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--calibrate", type=Path, default=None,
                        help="a real run's state folder (trainers/*.jsonl, jobs.sqlite): fit the step time, memory "
                             "and job start-up models to it instead of the trace's calibration")
    parser.add_argument("--without-moves", action="store_true",
                        help="also run each policy that moves jobs between trainers with its moves off")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        if args.calibrate:
            trace = trace.model_copy(update={"calibration": calibrate(args.calibrate, trace.calibration)})
        results = simulate(trace, [p.strip() for p in args.policies.split(",") if p.strip()], args.without_moves)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    c = trace.calibration
    print(f"trace {trace.name}: {len(trace.jobs)} jobs, {len(trace.trainers)} trainer(s); step ≈ "
          f"{c.step.constant:.3g} s "
          f"+ {c.step.per_token:.3g} s/token + {c.step.per_square:.3g} s/token²; job start {c.job_start_seconds:.2f} s")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"trace": trace.name, "calibration": c.model_dump(),
                                         "results": [r.row() for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
