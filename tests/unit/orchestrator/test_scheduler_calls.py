"""A service call that times out names the connected cluster's own log folder (a cluster started with
`ray start --temp-dir` keeps its logs there, not under /tmp/ray), and Ray's default where the driver knows none; a
"try it" whose trainer stayed busy is the service's answer, told as such."""

from __future__ import annotations

import types

import pytest
import ray
from ray.exceptions import GetTimeoutError

from orchestrator import scheduler_calls
from orchestrator.errors import ServiceError


def test_a_timed_out_call_names_the_clusters_log_folder(monkeypatch, tmp_path):
    def never(ref, timeout):
        raise GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", never)
    node = types.SimpleNamespace(get_logs_dir_path=lambda: str(tmp_path / "session_x" / "logs"))
    monkeypatch.setattr(ray._private.worker.global_worker, "node", node, raising=False)
    with pytest.raises(ServiceError, match=rf"did not answer within 5s; .* or {tmp_path}/session_x/logs\)"):
        scheduler_calls._call(object(), timeout=5)
    monkeypatch.setattr(ray._private.worker.global_worker, "node", None, raising=False)
    with pytest.raises(ServiceError, match=r"/tmp/ray/session_latest/logs \(Ray's default temp dir\)"):
        scheduler_calls._call(object(), timeout=5)


def test_a_busy_trainers_answer_reaches_the_caller_as_such_and_keeps_the_service(monkeypatch):
    """A "try it" whose trainer stayed busy past the scheduler's wait arrives as the scheduler's own TrainerBusy
    (not a ServiceError that the service cannot answer), and the HTTP layer answers it 503 with its message and a
    Retry-After, keeping its client of the service (a service that cannot answer is connected again)."""
    from fastapi import HTTPException
    from ray.exceptions import RayTaskError

    from actors.service.scheduler.call_waits import BUSY_RETRY_AFTER_S, TrainerBusy, busy_message
    from orchestrator.service_calls import ServiceLink, call_service

    busy = TrainerBusy(busy_message("trainer trainer-1", 90.0))

    def answer(ref, timeout):
        raise RayTaskError("SchedulerActor.generate", "Traceback ...", busy)

    class Client:
        def generate(self) -> None:
            scheduler_calls._call(object())

    monkeypatch.setattr(ray, "get", answer)
    with pytest.raises(TrainerBusy) as raised:
        scheduler_calls._call(object())
    client = Client()
    link = ServiceLink(client=client)
    with pytest.raises(HTTPException) as http:
        call_service(link, lambda service: service.generate())
    assert str(raised.value) == str(busy)
    assert str(busy).startswith("trainer trainer-1 is busy with a training step or another generation: it did not "
                                "answer this \"try it\" within 90 s")
    assert (http.value.status_code, http.value.detail) == (503, str(busy))
    assert http.value.headers == {"Retry-After": str(BUSY_RETRY_AFTER_S)}
    assert link.client() is client
