"""A plug-in policy that hangs, in the real service on the local Ray: its `decide` never returns once a job named
`poison` is queued. It held the scheduler's lock for good: the next submission, every status call and `info`
waited for ever, and no job started again. Now each call answers within the policy's time limit
(`policy_timeout_s`), the hung round and the next ones are FIFO's, FIFO replaces the policy, and every job trains
to its end; the service's info says why. The reference: the same jobs before the poison, which the policy itself
schedules and trains.

A policy that is slow but within its limit held the scheduler actor's lock while it decided: a status call, a
submission and a cancel of any user waited for the round. They now answer while it decides, and a job cancelled
meanwhile is not started by the round's decisions. The reference: the wall clock and the job's transitions in the
service's own table.

Its rounds' pace counted its time in their 2% share (6 s held the next round back 300 s): a job submitted after
its round now starts within its time and a tick, not minutes."""

from __future__ import annotations

import time

import pytest

from orchestrator.client import Client
from tests.helpers.fault_policies import SlowOnSlow, answered_within
from tests.helpers.service import NO_LISTENERS, job_dict, run_spec, service_config, write_task_data

LIMIT_S = 2.0


@pytest.mark.long   # 60-120 s on a shared 2-core machine: a service, three 3-step jobs
def test_a_hanging_plug_in_policy_stalls_no_call_and_the_jobs_train(ray_session, tiny_model_dirs, tmp_path):
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], listeners={
        **NO_LISTENERS, "policy": "tests.helpers.fault_policies:HangsOnPoison", "policy_timeout_s": LIMIT_S})
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    client = Client.local(config)
    try:
        first = client.submit_run(run_spec(base, tmp_path / "first", [job_dict("alpha", write_task_data(data, "a"), 3)],
                                           step_tokens=512))
        assert client.wait_all([h.id for h in first], timeout=180)[0].state == "completed"
        assert "policy_error" not in client.info()   # the policy scheduled it
        poison = client.submit_run(run_spec(base, tmp_path / "poison",
                                            [job_dict("poison", write_task_data(data, "p"), 3)], step_tokens=512))
        time.sleep(0.5)   # a round or more asks the policy, which hangs
        later, took = answered_within(lambda: client.submit_run(run_spec(
            base, tmp_path / "later", [job_dict("beta", write_task_data(data, "b"), 3)], step_tokens=512)), 60)
        assert took < LIMIT_S + 10, took
        status, took = answered_within(lambda: client.status(poison[0].id), 60)
        assert took < LIMIT_S + 10 and status.id == poison[0].id
        records = client.wait_all([h.id for h in (*poison, *later)], timeout=180)
        assert [r.state for r in records] == ["completed", "completed"], records
        info, _ = answered_within(client.info, 60)
    finally:
        client.shutdown()
    assert info["policy"] == "fifo"
    assert info["policy_error"].startswith("policy 'hangs-on-poison' overran its time limit 3 rounds in a row")
    assert info["policy_error"].endswith("its call of an earlier round has not returned yet (it ran past 2 s, the "
                                         "scheduler's policy_timeout_s)); the service schedules FIFO until it "
                                         "restarts with a working policy"), info["policy_error"]
    assert info["policy_warnings"][0].startswith("policy 'hangs-on-poison' overran its time limit: its call of an "
                                                 "earlier round has not returned yet"), info["policy_warnings"]
    assert "this round was decided by FIFO (2 so far)" in info["policy_warnings"][0]


@pytest.mark.long   # 20-60 s on a shared 2-core machine: a service whose trainer loads, no training
def test_calls_answer_while_a_slow_policy_decides_and_a_job_cancelled_meanwhile_stays_so(ray_session, tiny_model_dirs,
                                                                                       tmp_path):
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], listeners={
        **NO_LISTENERS, "policy": "tests.helpers.fault_policies:SlowOnSlow", "policy_timeout_s": 30.0})
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    client = Client.local(config)
    try:
        client.wait_ready(timeout=180)
        slow = client.submit_run(run_spec(base, tmp_path / "slow", [job_dict("slow", write_task_data(data, "s"), 3)],
                                          step_tokens=512))
        time.sleep(1.0)   # a round asks the policy, which takes SlowOnSlow.SECONDS
        asked = time.monotonic()
        status, took_status = answered_within(lambda: client.status(slow[0].id), 60)
        _, took_submit = answered_within(lambda: client.submit_run(run_spec(
            base, tmp_path / "later", [job_dict("later", write_task_data(data, "l"), 3)], step_tokens=512)), 60)
        cancelled, took_cancel = answered_within(lambda: client.cancel(slow[0].id), 60)
        took = (took_status, took_submit, took_cancel)
        assert max(took) < 2.0, f"status, submit and cancel waited {took} s (behind the policy's round?)"
        assert time.monotonic() - asked < SlowOnSlow.SECONDS - 1.5, "the calls came after the policy's round"
        time.sleep(SlowOnSlow.SECONDS)   # the round's decisions (a Start of the slow job) are applied by now
        transitions = [state for _, state, _ in client.transitions(slow[0].id)]
        final = client.status(slow[0].id)
    finally:
        client.shutdown()
    assert status.state == "queued" and cancelled.state == "cancelled" and final.state == "cancelled", final
    assert "running" not in transitions, transitions   # the policy's Start of it was not carried out


@pytest.mark.long   # 20-60 s on a shared 2-core machine: a service whose trainer loads, two 3-step jobs
def test_a_job_submitted_after_a_slow_policys_round_starts_within_its_time_not_minutes(ray_session, tiny_model_dirs,
                                                                                      tmp_path):
    """The rounds' pace counted the policy's time in their 2% share: after a round whose policy took
    SlowOnSlow.SECONDS (6 s, within its limit) the next one came 300 s later, and a job submitted meanwhile waited
    that long. Now the next round comes the policy's time after it (docs/scheduling.md, "Round pace"); this job's
    own round is quick (no `slow` job queued). The reference: the wall clock and the service's own job states."""
    config = service_config(tmp_path / "state", tiny_model_dirs["llama"], listeners={
        **NO_LISTENERS, "policy": "tests.helpers.fault_policies:SlowOnSlow", "policy_timeout_s": 30.0})
    base = str(tiny_model_dirs["llama"])
    data = tmp_path / "data"
    client = Client.local(config)

    def left_the_queue(job_id: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if client.status(job_id).state != "queued":
                return True
            time.sleep(0.1)
        return False

    try:
        client.wait_ready(timeout=180)
        slow = client.submit_run(run_spec(base, tmp_path / "slow", [job_dict("slow", write_task_data(data, "s"), 3)],
                                          step_tokens=512))
        assert left_the_queue(slow[0].id, 60), "the slow policy's round never started its job"
        submitted = time.monotonic()
        later = client.submit_run(run_spec(base, tmp_path / "later",
                                           [job_dict("later", write_task_data(data, "l"), 3)], step_tokens=512))
        started = left_the_queue(later[0].id, 90)
        took = time.monotonic() - submitted
        state = client.status(later[0].id).state
    finally:
        client.shutdown()
    assert started, f"the job submitted after the slow policy's round was still queued after {took:.0f} s"
    assert state in ("running", "completed") and took < SlowOnSlow.SECONDS + 5.0, (state, took)
