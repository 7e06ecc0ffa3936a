"""A lost trainer's Tinker model that cannot be placed again is given up, and its job ends: through the real
`tinker` SDK on `aspen http` over a running service (a real local Ray) of one trainer. dave trains a model; an admin
sets his `running` quota to 0 (no job of his may run) and his trainer is killed during a call. The front's
re-placement is refused (his quota never lets the model run now), so it gives the model up: his call fails with
why. Its job once stayed `queued` in the table for ever (a model nobody can use, shown by `aspen status`); now it
ends `failed` with the reason his call got, naming the checkpoint kept in its folder. The reference: the service's
own job table (`Client.status`) and the SDK's failed future."""

from __future__ import annotations

import uuid

import pytest

from actors.service.accounts.users import UserBook
from actors.service.scheduler.config import NAMESPACE, ServiceConfig, TrainerConfig
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.bridge import ProcessLink
from tests.helpers.http_server import running_server
from tests.helpers.service import NO_LISTENERS, wait_for
from tests.helpers.tinker_sdk import datums

tinker = pytest.importorskip("tinker")

pytestmark = [pytest.mark.service, pytest.mark.usefixtures("closes_tinker_clients")]


@pytest.mark.long   # a service whose trainer is killed (1-2 min)
def test_a_lost_trainers_model_that_cannot_be_placed_again_ends_its_job_failed(ray_session, tiny_model_dirs,
                                                                              tmp_path):
    import ray

    base, state = str(tiny_model_dirs["llama"]), tmp_path / "state"
    book = UserBook.in_state_dir(state)
    root, _ = book.add("root", admin=True)
    dave, _ = book.add("dave")
    name = f"aspen-giveup-{uuid.uuid4().hex[:6]}"
    client = Client.local(ServiceConfig(state_dir=state, trainers=[TrainerConfig(base_model=base, step_tokens=512,
                                                                                 num_cpus=0.5, threads=1)],
                                        tick_seconds=0.1, **NO_LISTENERS), name=name)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    try:
        client.wait_ready(timeout=300)
        app = create_app(link, root, users=book, tinker_dir=lambda: state / "tinker")
        with running_server(app) as url:
            service = tinker.ServiceClient(base_url=url, api_key=f"tml-{dave}")
            training = service.create_lora_training_client(base_model=base, rank=4, seed=0).result(timeout=120)
            row = ([1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [1.0] * 5)
            training.forward_backward(datums([row]), "cross_entropy").result(timeout=120)
            (model,) = [r for r in client.jobs() if r.name.endswith(training.model_id.replace(":", "-"))]
            assert client.status(model.id).state == "running"
            book.update("dave", quotas={"running": 0})
            (lost,) = client.trainers()
            ray.kill(ray.get_actor(lost["actor_name"], namespace=NAMESPACE), no_restart=True)
            pending = training.forward_backward(datums([row]), "cross_entropy")   # finds the trainer dead
            with pytest.raises(Exception) as failed:
                pending.result(timeout=240)
            said = str(failed.value)
            assert "could not be placed again" in said and "max_running quota is 0" in said, said
            ended = wait_for(lambda: (r := client.status(model.id)).finished and r, timeout=60,
                             what="the given-up model's job ended", state=lambda: client.status(model.id))
            assert ended.state == "failed", ended
            assert "could not be placed again" in ended.reason and "max_running quota is 0" in ended.reason, ended
            assert "checkpoint" in ended.reason and str(state / "tinker") in ended.reason, ended
            assert ended.trainer is None, ended
            service.close("success").result(timeout=120)   # its session ends: nothing left to finish
    finally:
        link.close()
        client.shutdown()
