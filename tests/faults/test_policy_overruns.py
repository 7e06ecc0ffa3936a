"""Plug-in policies that misbehave without raising, as an operator who installs a third-party policy meets them:

- one whose `decide` hangs held the scheduler's lock with it (its call had no time limit): every submission and
  status call of every user waited. Now a round waits for it at most `policy_timeout_s`, is decided by FIFO instead
  (said in the log and the service's info), the call still running is not made again, and after three such rounds
  in a row FIFO replaces the policy; the scheduler's loop, its lock and its pace are the service's own
  (`SchedulerLoop`, as `SchedulerActor` drives it).
- a Preempt of a queued job, or a decision on a job id that does not exist, was dropped without a word, or logged
  every round: now said once per policy and job, in the log and the info's `policy_warnings`. So is a Start of a
  job that runs, a Move that cannot be made, and a Start the placement refuses: those were logged at warning on
  every round (a round every 0.05 s) while the policy asked them, and not shown in the info.
- a Wait's free-form cause became a Prometheus label each: the set of labels grew without bound. Now the built-in
  causes are labels and any other is counted as "other", its text kept in the job's reason.

The references: FIFO's own decisions on the same jobs (what the round is decided by), the job table's states, and
prometheus_client's registry as Prometheus scrapes it."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, generate_latest

from actors.service.scheduler.policy_guard import POLICY_OVERRUNS_BEFORE_FIFO
from orchestrator.metric_families import SchedulerMetrics
from policies.base import WAIT_CAUSES, Start
from policies.fifo import FifoPolicy
from tests.helpers.fault_policies import (
    DecidesOnGhosts,
    FreeFormCauses,
    Hangs,
    PreemptsQueued,
    RepeatsImpossible,
    answered_within,
)
from tests.helpers.policy_service import LIMIT_S, ServiceLoop, core_with, more_jobs
from tests.helpers.trainer import fake_status

ONE_JOB = 150 * 2**20 + 20_000   # fake_status's base and step memory, and one of core_with's jobs (14,336 bytes)


def test_a_hanging_policy_stalls_no_call_its_rounds_go_to_fifo_and_then_fifo_replaces_it(tmp_path, caplog):
    policy = Hangs()
    core, records = core_with(policy, tmp_path)
    fifo_reference = [Start(r.id, "trainer-0") for r in records]   # FIFO: submission order
    try:
        with caplog.at_level(logging.WARNING), ServiceLoop(core) as service:
            assert policy.entered.wait(10), "the policy was never asked"
            # another user's submission and status calls answer while the policy hangs
            later, took = answered_within(lambda: service.locked(lambda: more_jobs(core, tmp_path, "delta")), 10)
            assert took < LIMIT_S + 2, took
            status, took = answered_within(lambda: service.locked(lambda: core.table.find(records[0].id)), 10)
            assert took < LIMIT_S + 2 and status.id == records[0].id
            # the hung round was decided by FIFO, and FIFO replaced the policy after a few rounds, in seconds (the
            # wait for the policy does not count in the rounds' pace: 0.5 s / 2 % would hold them back 25 s)
            def states() -> dict[str, str]:
                with service.lock:
                    return {r.id: core.table.get(r.id).state for r in [*records, *later]}

            deadline = time.monotonic() + 5
            while (core.policy_error is None or set(states().values()) != {"running"}) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert core.policy.name == "fifo", core.guard.describe()
            assert set(states().values()) == {"running"}, states()   # the later job started too
            with service.lock:
                decided = [a for actions in service.rounds for a in actions]
    finally:
        policy.release.set()
    assert decided[:len(records)] == fifo_reference
    assert policy.calls == 1   # never called again while its call ran
    info = core.guard.describe()
    assert info["policy_error"].startswith(f"policy 'hangs' overran its time limit {POLICY_OVERRUNS_BEFORE_FIFO} "
                                           "rounds in a row (the last: its call of an earlier round has not "
                                           f"returned yet (it ran past {LIMIT_S:g} s, the scheduler's "
                                           "policy_timeout_s)); the service schedules FIFO"), info
    assert "policy 'hangs' overran its time limit" in info["policy_warnings"][0]
    assert (f"policy 'hangs' overran its time limit: it did not answer within {LIMIT_S:g} s (the scheduler's "
            "policy_timeout_s); this round was decided by FIFO (1 so far)") in caplog.text


def test_a_policy_that_overran_once_is_not_called_twice_at_once_and_keeps_deciding(tmp_path):
    """Its first call blocks past the limit; while it runs, rounds are FIFO's and it is not called; once it has
    returned (its late answer dropped) it is asked again, answers in time, and stays the policy."""
    policy = Hangs(first_only=True)
    core, records = core_with(policy, tmp_path, names=("alpha",))
    status = fake_status("trainer-0", "smollm2-135m")
    first, took = answered_within(lambda: core.plan([status]), 10)
    assert first == [Start(records[0].id, "trainer-0")] and took < LIMIT_S + 2   # FIFO's decision, after the limit
    assert policy.calls == 1 and core.guard.overruns == 1
    later = more_jobs(core, tmp_path, "beta")
    assert core.plan([status]) == [Start(later[0].id, "trainer-0")]   # the call still runs: FIFO, at once
    assert policy.calls == 1 and core.guard.overruns == 2
    policy.release.set()
    deadline = time.monotonic() + 5
    while policy.running and time.monotonic() < deadline:
        time.sleep(0.01)
    third = more_jobs(core, tmp_path, "gamma")
    assert core.plan([status]) == [Start(third[0].id, "trainer-0")]
    assert policy.calls == 2 and policy.most_at_once == 1
    assert core.policy is policy and core.policy_error is None and core.guard.overruns == 0
    assert "2 so far" in core.guard.describe()["policy_warnings"][0]


def test_a_preempt_of_a_queued_job_is_said_once_naming_policy_job_and_state(tmp_path, caplog):
    core, (running, waiting) = core_with(PreemptsQueued(), tmp_path, names=("alpha", "beta"))
    full = fake_status("trainer-0", "smollm2-135m", budget=ONE_JOB)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            actions = core.plan([full])
    assert core.table.get(running.id).state == "running"
    assert core.table.get(waiting.id).state == "queued"   # not preempted: it does not run
    assert not any(a.job == waiting.id for a in actions)
    said = [r.getMessage() for r in caplog.records if "preempted job" in r.getMessage()]
    assert len(said) == 1, said   # once, not every round
    assert (f"policy 'preempts-queued' preempted job {waiting.id} ('make room'), which is queued, not running: "
            "not done") in said[0]
    assert core.guard.describe()["policy_warnings"] == [said[0].removeprefix("scheduler: ")]


def test_a_decision_on_a_job_that_does_not_exist_is_said_once_and_shown_in_the_info(tmp_path, caplog):
    core, records = core_with(DecidesOnGhosts(), tmp_path, names=("alpha",))
    status = fake_status("trainer-0", "smollm2-135m")
    with caplog.at_level(logging.WARNING):
        actions = [core.plan([status]) for _ in range(5)]
    assert actions[0] == [Start(records[0].id, "trainer-0")]   # the real job goes on (FIFO's start)
    said = [r.getMessage() for r in caplog.records if "ghost-job" in r.getMessage()]
    assert len(said) == 1, said
    assert "policy 'decides-on-ghosts' decided Start(job='ghost-job'" in said[0]
    assert "the scheduler has no active job 'ghost-job': not done" in said[0]
    assert core.guard.describe()["policy_warnings"] == [said[0].removeprefix("scheduler: ")]


def test_starts_and_moves_that_cannot_be_done_are_said_once_per_job_not_every_round(tmp_path, caplog):
    core, (running, waiting) = core_with(RepeatsImpossible(), tmp_path, names=("alpha", "beta"))
    with caplog.at_level(logging.WARNING):
        actions = [core.plan([fake_status("trainer-0", "smollm2-135m", budget=ONE_JOB,
                                          jobs=[running.id] if rounds else [])]) for rounds in range(6)]
    # the reference: FIFO's start of the first job, and nothing else done in any round (the table says so)
    assert actions == [[Start(running.id, "trainer-0")], [], [], [], [], []], actions
    assert core.table.get(running.id).state == "running" and core.table.get(running.id).trainer == "trainer-0"
    assert core.table.get(waiting.id).state == "queued"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 3, said   # one of each kind, not one a round
    assert said[0] == (f"scheduler: policy repeats-impossible started job {waiting.id} on trainer-9, not done: "
                       "there is no trainer 'trainer-9' (trainers now: trainer-0)")
    assert said[1] == (f"scheduler: policy 'repeats-impossible' started job {running.id} on trainer-0, which is "
                       "running on trainer-0, not queued: not done (only a queued job can be started)")
    assert said[2] == (f"scheduler: policy 'repeats-impossible' moved job {running.id} (running on trainer-0) to "
                       "trainer-9, but there is no trainer 'trainer-9' (trainers now: trainer-0): not done")
    assert core.guard.describe()["policy_warnings"] == [line.removeprefix("scheduler: ") for line in said]


def test_free_form_wait_causes_do_not_grow_the_metrics_label_set(tmp_path):
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)
    core, records = core_with(FreeFormCauses(), tmp_path, names=("alpha", "beta"),
                              on_decision=lambda kind, job, reason: metrics.decided(kind))
    status = fake_status("trainer-0", "smollm2-135m")
    before = generate_latest(registry).decode()
    for index in range(4):
        records += more_jobs(core, tmp_path, f"more{index}")
        with core.table.transaction():
            core.plan([status])
    scraped = generate_latest(registry).decode()
    kinds = {line.split('kind="')[1].split('"')[0] for line in scraped.splitlines()
             if line.startswith("aspen_scheduler_decisions_total{")}
    causes = {line.split('cause="')[1].split('"')[0] for line in scraped.splitlines()
              if line.startswith("aspen_admissions_deferred_total{")}
    assert causes == set(WAIT_CAUSES) and kinds == {"start", "preempt", "move", *(f"wait_{c}" for c in WAIT_CAUSES)}
    assert len(scraped.splitlines()) == len(before.splitlines())   # no series added, only counts
    assert 'aspen_admissions_deferred_total{cause="other"} 6.0' in scraped   # each job once (its first wait)
    reason = core.table.get(records[0].id).reason
    assert reason.startswith("held back by free-form (")
    assert f"(the policy's cause: waiting on {records[0].id} #" in reason   # the cause's text, kept
    # the built-in causes stay their own labels: FIFO's memory wait on a trainer too small is counted as memory
    fifo_core, _ = core_with(FifoPolicy(), tmp_path / "fifo", names=("alpha", "beta"),
                             on_decision=lambda kind, job, reason: metrics.decided(kind))
    with fifo_core.table.transaction():
        fifo_core.plan([fake_status("trainer-0", "smollm2-135m", budget=ONE_JOB)])
    assert 'aspen_admissions_deferred_total{cause="memory"} 1.0' in generate_latest(registry).decode()
