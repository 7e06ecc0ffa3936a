"""Abandoned samples (the SDK's `cancel_future`, on because aspen's dynamic client config enables it): a sample its
user cancels while it waits for the trainer is never sampled, the other samples of that batch are, and only
sampling requests can be cancelled. Driven by the real `tinker` SDK against aspen's Tinker API under uvicorn; the
trainer is held busy by a call of another model until the cancel has arrived."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from actors.service.trainer import interactive_passes
from tests.helpers.tinker_sdk import datums, tiny_api

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

BASE = "tiny-llama"
KEYS = {"alice-token": "alice"}


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tiny_api(tmp_path, KEYS, window_s=0.05) as served:
        yield served


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_sample_cancelled_while_it_waits_is_never_sampled(server, monkeypatch):
    url, backend, _ = server
    sampled: list[tuple[int, ...]] = []
    real = interactive_passes.SampleRun

    def recording(base, calls, decode):
        sampled.extend(call.prompt for call in calls)
        return real(base, calls, decode)

    monkeypatch.setattr(interactive_passes, "SampleRun", recording)
    polled: set[str] = set()
    real_retrieve = backend.sessions.retrieve

    async def polling(request_id, user, *args, **kwargs):
        polled.add(request_id)
        return await real_retrieve(request_id, user, *args, **kwargs)

    monkeypatch.setattr(backend.sessions, "retrieve", polling)
    release = threading.Event()
    backend.calls.create_model("blocker", 4, owner="alice")
    busy = backend.calls.submit("blocker", 1, "apply", lambda model: release.wait(60))   # the trainer is held here
    try:
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        sampler = client.create_sampling_client(base_model=BASE).result()
        params = types.SamplingParams(max_tokens=4, temperature=0.0)
        doomed = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, params)
        kept = sampler.sample(types.ModelInput.from_ints([8, 9]), 1, params)
        wait_until(lambda: len(backend.calls.sampling.waiting) == 2, "both samples to reach the trainer")
        # The SDK tells the server of a cancel only from its polling loop: a sample cancelled while its request's
        # answer is still on the way back is dropped by the client alone. So cancel once both are polled.
        wait_until(lambda: len(polled) == 2, "the client to poll both samples")
        doomed.future().cancel()
        wait_until(lambda: any(accepted.future.cancelled() for accepted in backend.sessions.futures.values()),
                   "the server to hear the cancel")
    finally:
        release.set()
    busy.result(timeout=60)
    assert len(kept.result().sequences[0].tokens) == 4
    assert sampled == [(8, 9)], "the cancelled sample never reached the sampler"
    client.close("success").result()


def test_a_retrieve_waiting_when_its_sample_is_cancelled_answers_cancelled(server):
    """A client's long poll (retrieve_future) for a sample still waits when the sample is cancelled: it answers
    the cancel, as a poll after the cancel does, not a server error."""
    url, backend, _ = server
    release = threading.Event()
    backend.calls.create_model("blocker", 4, owner="alice")
    busy = backend.calls.submit("blocker", 1, "apply", lambda model: release.wait(60))   # the trainer is held here
    headers = {"X-API-Key": "tml-alice-token"}
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    try:
        sampler = client.create_sampling_client(base_model=BASE).result()
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=4))
        wait_until(lambda: len(backend.calls.sampling.waiting) == 1, "the sample to reach the trainer")
        (request_id,) = [key for key, accepted in backend.sessions.futures.items() if accepted.cancellable]
        polled: dict = {}

        def poll() -> None:
            polled["answer"] = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers,
                                          json={"request_id": request_id}, timeout=60)

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.5)   # the poll waits for the sample's answer
        assert "answer" not in polled
        assert httpx.post(f"{url}/api/v1/cancel_future", headers=headers,
                          json={"request_id": request_id}).status_code == 200
        poller.join(timeout=30)
        after = httpx.post(f"{url}/api/v1/retrieve_future", headers=headers, json={"request_id": request_id})
    finally:
        release.set()
    busy.result(timeout=60)
    assert after.status_code == 200 and "was cancelled" in after.json()["error"]
    assert polled["answer"].status_code == 200, polled["answer"].text
    assert polled["answer"].json() == after.json()
    client.close("success").result()


def test_only_sampling_requests_can_be_cancelled(server):
    """A model's calls run in order and none may be dropped: cancelling a forward_backward is refused (400), an
    unknown request is 404."""
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    training.forward_backward(datums([([1, 2, 3], [2, 3, 4], [1.0, 1.0, 1.0])]), "cross_entropy").result()
    headers = {"X-API-Key": "tml-alice-token"}
    training_request = next(iter(server[1].sessions.futures))
    refused = httpx.post(f"{url}/api/v1/cancel_future", headers=headers, json={"request_id": training_request})
    assert refused.status_code == 400 and "only those can be cancelled" in refused.json()["detail"]
    unknown = httpx.post(f"{url}/api/v1/cancel_future", headers=headers, json={"request_id": "req-none"})
    assert unknown.status_code == 404
    client.close("success").result()
