"""`aspen run --in-process` with a policy that also composes steps (`compose_step`) and whose `decide` hangs: the
round waits for it at most `policy_timeout_s` and leaves it running in its thread (policy_clock.py), and the trainer
called the same object's `compose_step` for each step meanwhile, from another thread, on the policy's own state. Now
a step's `compose_step` is never called while its `decide` runs: those steps are composed in turn (as without a
composer), said once in the run's `policy_warnings`, and the jobs train to their ends. The references: the policy's
own count of calls made while a decide of it ran, and the jobs' steps against their max_steps."""

from __future__ import annotations

from actors.engine.models import load_base_model
from actors.service.scheduler import local_run
from actors.service.scheduler.local_run import train_locally
from actors.service.scheduler.policy_clock import POLICY_TIMEOUT_S
from orchestrator.jobs_file import load_run_spec
from tests.helpers.fault_policies import ComposesAndHangs
from tests.helpers.interrupted_runs import write_run


def test_compose_step_is_never_called_while_the_policys_decide_runs(tmp_path, tiny_model_dirs, monkeypatch):
    policy = ComposesAndHangs()
    monkeypatch.setattr(local_run, "load_policy", lambda name: policy)
    spec = load_run_spec(write_run(tmp_path, tiny_model_dirs["llama"], steps=4))
    said: list[dict] = []
    try:
        summaries = train_locally(spec, base=load_base_model(str(tiny_model_dirs["llama"]), dtype="float32",
                                                             device="cpu"), progress=False, policy_said=said.append)
    finally:
        policy.release.set()
    assert [(s.state, s.steps) for s in summaries] == [("completed", 4)] * len(spec.jobs), summaries
    assert policy.calls == 2   # the second call hung, and was not made again while it ran
    assert policy.overlaps == 0, f"{policy.overlaps} of {policy.composed} compose_step calls ran during a decide"
    warnings = said[0]["policy_warnings"]
    assert ("policy 'composes-and-hangs': its compose_step was not called while its decide ran past "
            f"{POLICY_TIMEOUT_S:g} s (policy_timeout_s; both use the policy's state): those steps took each job's "
            "next micro-batch in turn, as without a step composer") in warnings, warnings
    assert said[0]["policy_error"].startswith("policy 'composes-and-hangs' overran its time limit 3 rounds in a row")
