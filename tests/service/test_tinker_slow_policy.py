"""A Tinker training client created while a slow plug-in policy decides, on `aspen http` over a running service (a
real local Ray), driven by the real `tinker` SDK: the policy decides on its round's snapshot with the service's lock
released, so the SDK's create is answered meanwhile, and its model's memory (adapter, gradients, AdamW state) is held
on the trainer the policy's Start was made for. That Start, of a job that fitted the trainer's budget by the snapshot
but not beside the model, is not carried out: the job stays queued, its reason naming the model and the memory
left; the next round, which sees the model, has it wait for memory. (The scheduler-level tests,
tests/faults/test_policy_slow_rounds.py and test_policy_freed_room.py, open the model in-process.)

The references: the trainer's fixed and step memory as a first service of the same kind reports them, the adapters'
memory counted from the base's layer shapes (LoRA's A and B, fp32 weight, gradient and two AdamW moments per
parameter), and the job's transitions in the service's own table."""

from __future__ import annotations

import uuid

import pytest

from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.bridge import ProcessLink
from tests.helpers.fault_policies import GatedOnFile
from tests.helpers.http_server import running_server
from tests.helpers.service import NO_LISTENERS, job_dict, run_spec, service_config, wait_for, write_task_data
from tests.helpers.tinker_sizes import JOB_RANK, MODEL_RANK, fixed_bytes, lora_bytes

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]

@pytest.mark.long   # 1-3 min on a shared 2-core machine: two services whose trainer loads, no training
def test_a_training_client_created_while_a_slow_policy_decides_holds_its_memory_against_the_policys_start(
        ray_session, tiny_model_dirs, tmp_path):
    from actors.service.accounts.users import UserBook

    base = str(tiny_model_dirs["llama"])
    job_bytes, model_bytes = lora_bytes(base)
    first = Client.local(service_config(tmp_path / "first", tiny_model_dirs["llama"]))
    try:
        fixed = fixed_bytes(first)
    finally:
        first.shutdown()
    # either fits beside the trainer's fixed memory, not both: half the model's memory is the margin for another
    # trainer process's runtime (a CPU trainer's budget counts its resident set)
    budget = fixed + job_bytes + model_bytes // 2
    state = tmp_path / "state"
    alice, _ = UserBook.in_state_dir(state).add("alice")
    root, _ = UserBook.in_state_dir(state).add("root", admin=True)
    name = f"aspen-gated-{uuid.uuid4().hex[:6]}"
    client = Client.local(service_config(state, tiny_model_dirs["llama"], memory_budget_bytes=budget, listeners={
        **NO_LISTENERS, "policy": "tests.helpers.fault_policies:GatedOnFile", "policy_timeout_s": 300.0}), name=name)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    gated: list[str] = []
    try:
        now = fixed_bytes(client)
        assert now + job_bytes <= budget and now + model_bytes <= budget < now + job_bytes + model_bytes, (
            f"this trainer's fixed memory ({now} bytes) is too far from the first one's ({fixed}): the budget "
            f"{budget} must fit the job ({job_bytes}) or the model ({model_bytes}) beside it, not both")
        app = create_app(link, root, users=UserBook.in_state_dir(state), tinker_dir=lambda: state / "tinker")
        with running_server(app) as url:
            data = write_task_data(tmp_path / "data", "g")
            lora = {"r": JOB_RANK, "alpha": 16, "target_modules": "all-linear"}
            (job,) = client.submit_run(run_spec(base, state / "outputs", [job_dict("gated", data, 3, lora=lora)],
                                                step_tokens=512))
            gated.append(job.id)
            wait_for(lambda: GatedOnFile.gate(job.id, "entered").exists(), what="the policy's round on the job",
                     timeout=120)
            sdk = tinker.ServiceClient(base_url=url, api_key=f"tml-{alice}")
            training = sdk.create_lora_training_client(base_model=base, rank=MODEL_RANK).result(timeout=120)
            (model,) = [r for r in client.jobs() if r.name.endswith(training.model_id.replace(":", "-"))]
            assert client.status(job.id).state == "queued"   # the round still waits for the policy
            GatedOnFile.gate(job.id, "go").touch()
            judged = wait_for(lambda: ((r := client.status(job.id)).state != "queued"
                                       or "while the policy decided" in r.reason) and r,
                              what="the policy's Start judged", timeout=120)
            assert judged.state == "queued", f"started past the trainer's budget: {judged.reason}"
            reason = judged.reason
            again = wait_for(lambda: (r := client.status(job.id).reason).startswith("waiting for memory") and r,
                             what="the next round's decision", timeout=120)
            transitions = [state for _, state, _ in client.transitions(job.id)]
            assert client.cancel(job.id).state == "cancelled"
            sdk.close("success").result(timeout=120)
    finally:
        link.close()
        client.shutdown()
        for job_id in gated:
            for which in ("entered", "go"):
                GatedOnFile.gate(job_id, which).unlink(missing_ok=True)
    assert model.state == "running" and model.trainer == "trainer-0" and model.user == "alice"
    assert reason == (f"waiting: the scheduling policy 'gated-on-file' started it on trainer-0, but while the policy "
                      f"decided, {model.id} ({model_bytes / 2**20:.1f} MiB) started on trainer-0: it needs "
                      f"{job_bytes / 2**20:.1f} MiB and trainer-0's memory budget has "
                      f"{(budget - now - model_bytes) / 2**20:.1f} MiB free now; it stays queued and the next round "
                      "decides again"), reason
    assert f"needs {job_bytes / 2**20:.0f} MiB" in again, again
    assert "running" not in transitions, transitions   # never started past the trainer's budget
