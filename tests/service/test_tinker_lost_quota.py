"""A lost trainer's Tinker model placed again within its user's `running` quota, through the real `tinker` SDK on
`aspen http` over a running service (a real local Ray) of two trainers: trainer-0 holds the model's base, trainer-1
another. carol (`running=1`) trains a model on trainer-0; her batch job on trainer-1's base waits for her quota.
trainer-0 is killed during a call of hers: the loss queues her model, so the policy starts her batch job on trainer-1
at once, while trainer-0's successor loads. The model was then placed again without her quota checked: carol ran
two jobs at `running=1`. Now it waits, its job saying why, until her batch job ends; then it resumes and her call
is answered. The reference: the service's own job table, polled throughout (her running jobs), and the policy's
verdict on her batch job before the loss (waiting for her quota)."""

from __future__ import annotations

import threading

import pytest

from actors.service.accounts.users import UserBook
from orchestrator.http.api_client import HttpClient
from tests.helpers.service import job_dict, wait_for, write_task_data
from tests.helpers.tinker_sdk import datums
from tests.helpers.tinker_service import ROW, kill_trainer, model_job, tinker_service, trained_model, trainer

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]


@pytest.mark.long   # a service of two trainers, one killed and loaded again (1-3 min)
def test_a_lost_trainers_model_waits_while_its_user_runs_their_max_running_jobs(ray_session, tiny_model_dirs,
                                                                                tmp_path):
    base, other = str(tiny_model_dirs["llama"]), str(tiny_model_dirs["qwen2"])
    state, data = tmp_path / "state", write_task_data(tmp_path / "data", "long")
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    carol, _ = book.add("carol", data_roots=[str(data.parent)], quotas={"running": 1})
    most: list[list[str]] = [[]]
    stop = threading.Event()

    def poll(client) -> None:   # carol's running jobs, the most seen at once
        while not stop.wait(0.1):
            running = [f"{r.name}@{r.trainer}" for r in client.jobs() if r.state == "running" and r.user == "carol"]
            if len(running) > len(most[0]):
                most[0] = running
    try:
        with tinker_service(ray_session, state, [trainer(base), trainer(other)], root, book,
                            prefix="aspen-lostq") as (client, url, _):
            service, training = trained_model(tinker, url, carol, base)
            batch = HttpClient(url, carol).submit(job_dict("long", data, 100_000), base_model=other)
            wait_for(lambda: "their quota is 1 running" in client.status(batch.id).reason, timeout=60,
                     what="her batch job waiting for her quota", state=lambda: client.status(batch.id))
            watcher = threading.Thread(target=poll, args=(client,), daemon=True)
            watcher.start()
            pending = training.forward_backward(datums([ROW]), "cross_entropy")
            kill_trainer(client, "trainer-0")
            later = training.forward_backward(datums([ROW]), "cross_entropy")   # finds the trainer dead
            wait_for(lambda: client.status(batch.id).state == "running", timeout=120,
                     what="her batch job started once the loss queued her model",
                     state=lambda: client.status(batch.id))
            model = model_job(client, training)
            # (it may first wait for trainer-0's successor, its reason saying so)
            waiting = wait_for(lambda: ((r := client.status(model.id)).state == "running"
                                        or "waiting to be placed again: user carol runs 1 jobs (long)" in r.reason)
                               and r, timeout=240, what="her model waiting for her quota, saying so",
                               state=lambda: (client.status(model.id), client.trainers()))
            assert waiting.state == "queued", f"placed again past her quota (running=1): {waiting}"
            assert client.cancel(batch.id).state in ("cancelled", "running")
            wait_for(lambda: client.status(model.id).state == "running", timeout=120,
                     what="her model placed again once her batch job ended",
                     state=lambda: (client.status(model.id), client.status(batch.id), client.trainers()))
            for call in (pending, later):   # placed again once her batch job ended, its calls sent again
                assert "loss:sum" in call.result(timeout=240).metrics
            assert client.status(model.id).state == "running"
            service.close("success").result(timeout=120)
    finally:
        stop.set()
    assert len(most[0]) == 1, f"carol ran {most[0]} at once (running=1)"
