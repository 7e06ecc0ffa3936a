"""For tests that drive a running service (a real local Ray) through the real `tinker` SDK on `aspen http`: the
service, its HTTP API served in this process, a user's model trained one step, and its trainer killed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from actors.service.scheduler.config import NAMESPACE, ServiceConfig, TrainerConfig
from orchestrator.client import Client
from orchestrator.http.api import create_app
from orchestrator.http.bridge import ProcessLink
from tests.helpers.http_server import running_server
from tests.helpers.service import NO_LISTENERS
from tests.helpers.tinker_sdk import datums

ROW = ([1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [1.0] * 5)   # one supervised datum: tokens, targets, weights


def trainer(base: str | Path, **settings: Any) -> TrainerConfig:
    """A small trainer of `base` for these tests (`settings`: its others)."""
    return TrainerConfig(base_model=str(base), step_tokens=512, num_cpus=0.5, threads=1, **settings)


@contextmanager
def tinker_service(ray_session: Any, state: Path, trainers: list[TrainerConfig], admin_token: str, users: Any, *,
                   prefix: str, **config: Any) -> Iterator[tuple[Client, str, Any]]:
    """A service of `trainers` (its state in `state`, `config` its other settings) and its HTTP API with the
    Tinker routes: (its client, the API's URL, the API's app: its front's calls are `app.state.tinker.calls`)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    client = Client.local(ServiceConfig(state_dir=state, trainers=trainers, tick_seconds=0.1, **NO_LISTENERS,
                                        **config), name=name)
    link = ProcessLink(ray_session.get_runtime_context().gcs_address, name=name)
    try:
        client.wait_ready(timeout=300)
        app = create_app(link, admin_token, users=users, tinker_dir=lambda: state / "tinker")
        with running_server(app) as url:
            yield client, url, app
    finally:
        link.close()
        client.shutdown()


def trained_model(tinker: Any, url: str, token: str, base: str) -> tuple[Any, Any]:
    """A user's SDK session (its token `token`) and a rank-4 model of `base` that took one forward_backward."""
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{token}")
    training = service.create_lora_training_client(base_model=base, rank=4, seed=0).result(timeout=120)
    training.forward_backward(datums([ROW]), "cross_entropy").result(timeout=120)
    return service, training


def model_job(client: Client, training: Any) -> Any:
    """The job of the SDK's model `training` in the service's table."""
    (record,) = [r for r in client.jobs() if r.name.endswith(training.model_id.replace(":", "-"))]
    return record


def kill_trainer(client: Client, trainer_id: str) -> None:
    """Kill trainer `trainer_id`'s actor (not restarted by Ray: the service loads its successor)."""
    import ray

    (lost,) = [t for t in client.trainers() if t["id"] == trainer_id]
    ray.kill(ray.get_actor(lost["actor_name"], namespace=NAMESPACE), no_restart=True)
