"""A Tinker API server restarted under a user's loop knows none of its sessions and requests (they live in the
HTTP server, docs/tinker.md): what the SDK's next requests are answered says so and what to do, as one sentence
(a KeyError's message was quoted). The restarted server is a second server over a fresh base, sent the requests the
SDK sent the first."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.tinker_sdk import datums, tiny_api

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

KEYS = {"alice-token": "alice"}
HEADERS = {"X-API-Key": "tml-alice-token"}


def test_a_restarted_server_says_it_knows_no_earlier_session_or_request(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tiny_api(tmp_path / "first", KEYS, window_s=0.0) as (url, backend, _):
        client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
        training = client.create_lora_training_client(base_model="tiny-llama", rank=4).result()
        training.forward_backward(datums([([1, 2, 3], [2, 3, 4], [1.0, 1.0, 1.0])]), "cross_entropy").result()
        (session_id,) = backend.sessions.sessions
        request_id = next(iter(backend.sessions.futures))
        on_the_first = httpx.post(f"{url}/api/v1/retrieve_future", headers=HEADERS, json={"request_id": request_id})
        assert on_the_first.status_code == 200   # the reference: the first server answers them
        client.close("success").result()
    with tiny_api(tmp_path / "restarted", KEYS, window_s=0.0) as (url, _, _):
        beat = httpx.post(f"{url}/api/v1/session_heartbeat", headers=HEADERS,
                          json={"session_id": session_id, "type": "session_heartbeat"})
        retrieved = httpx.post(f"{url}/api/v1/retrieve_future", headers=HEADERS, json={"request_id": request_id})
    assert beat.status_code == 410
    assert beat.json()["detail"].startswith(f"no session {session_id} of yours on this server (")
    assert "restarted since knows none" in beat.json()["detail"] and "new ServiceClient" in beat.json()["detail"]
    assert retrieved.status_code == 404
    assert retrieved.json()["detail"].startswith(f"no request {request_id} of yours on this server (")
    assert "send the call again from a new ServiceClient" in retrieved.json()["detail"]
