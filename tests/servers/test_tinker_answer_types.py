"""The Tinker API's JSON answers against the SDK's own types (`tinker.types`, 0.38), the reference: every answer a
user's loop through the real SDK receives (recorded off the SDK's HTTP client) validates against the type the SDK
reads it into, with no field that type lacks (the SDK's types ignore extra fields: a field aspen sends that a later
SDK renamed would reach users as a missing value); and such a field fails the answer, saying which, where before it
was sent and silently dropped (a later SDK simulated by renaming a field of the SDK's type)."""

from __future__ import annotations

import asyncio

import httpx
import pydantic
import pytest

tinker = pytest.importorskip("tinker")

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tinker import types  # noqa: E402
from tinker.types.try_again_response import TryAgainResponse  # noqa: E402

from tests.helpers.tinker_api import ADAM, BASE, batch, greedy  # noqa: E402
from tests.helpers.tinker_sdk import datums  # noqa: E402

ROUTE_TYPES = {   # what the SDK reads each route's answer into (tinker/resources/, lib/public_interfaces/)
    "client/config": types.ClientConfigResponse, "client/dynamic_config": types.ClientDynamicConfigResponse,
    "create_session": types.CreateSessionResponse, "session_heartbeat": types.SessionHeartbeatResponse,
    "telemetry": types.TelemetryResponse, "get_server_capabilities": types.GetServerCapabilitiesResponse,
    "get_info": types.GetInfoResponse, "create_sampling_session": types.CreateSamplingSessionResponse,
    **dict.fromkeys(("create_model", "forward_backward", "optim_step", "save_weights", "load_weights",
                     "save_weights_for_sampler", "asample"), types.UntypedAPIFuture),
}
FUTURE_TYPES = {   # a future's answer, by its `type` (the SDK's APIFuture reads it into the call's type)
    "create_model": types.CreateModelResponse, "optim_step": types.OptimStepResponse,
    "save_weights": types.SaveWeightsResponse, "load_weights": types.LoadWeightsResponse,
    "save_weights_for_sampler": types.SaveWeightsForSamplerResponseInternal, "try_again": TryAgainResponse,
}


def unknown_fields(sdk_type: type[pydantic.BaseModel], payload: dict, where: str = "") -> list[str]:
    """The keys of `payload` (nested ones too) that `sdk_type` has no field for (after validating it)."""
    parsed = sdk_type.model_validate(payload)
    unknown = []
    for key, value in payload.items():
        if key not in sdk_type.model_fields:
            unknown.append(f"{where}{key}")
        elif isinstance(value, dict) and isinstance(getattr(parsed, key), pydantic.BaseModel):
            unknown += unknown_fields(type(getattr(parsed, key)), value, f"{where}{key}.")
    return unknown


@pytest.fixture
def answers(monkeypatch) -> list[tuple[str, dict]]:
    """(route, JSON answer) of every answer the SDK's HTTP client receives."""
    seen: list[tuple[str, dict]] = []
    send = httpx.AsyncClient.send

    async def recorded(self, request, **kwargs):
        response = await send(self, request, **kwargs)
        await response.aread()
        if response.headers.get("content-type", "").startswith("application/json") and response.content:
            seen.append((request.url.path.removeprefix("/api/v1/"), response.json()))
        return response
    monkeypatch.setattr(httpx.AsyncClient, "send", recorded)
    return seen


async def beat_and_telemetry(url: str, session_id: str) -> None:
    """A heartbeat and a telemetry batch, as the SDK sends them (every 10 s; telemetry is off in these tests)."""
    async with httpx.AsyncClient(base_url=f"{url}/api/v1", headers={"X-API-Key": "tml-alice-token"}) as client:
        (await client.post("/session_heartbeat", json={"session_id": session_id})).raise_for_status()
        (await client.post("/telemetry", json={"events": []})).raise_for_status()


def test_every_answer_of_a_users_loop_validates_against_the_sdks_type(sdk_server, answers):
    """A loop through the SDK (create, get_info, forward_backward, optim_step, save and load a state, sampler
    weights, sampling, a failed call): each JSON answer validates against the SDK's type for it, and carries no
    field that type lacks (a future's `type` aside, which the SDK's futures carry)."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    training.get_info()
    training.forward_backward(datums(batch(1)), "cross_entropy").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    state = training.save_state("s").result().path
    training.load_state(state).result()
    greedy(training.save_weights_and_get_sampling_client(), [5, 17])
    sampler = training.save_weights_for_sampler("w").result().path
    client.get_server_capabilities()
    greedy(client.create_sampling_client(model_path=sampler), [5, 17])
    asyncio.run(beat_and_telemetry(url, client.holder.get_session_id()))
    with pytest.raises(tinker.RequestFailedError):   # a token the base has no row for: a failed future
        training.forward(datums([([10**6, 1], [1, 2], [1.0, 1.0])]), "cross_entropy").result()
    client.close("success").result()

    checked = set()
    for route, payload in answers:
        if route == "retrieve_future":
            sdk_type = types.RequestFailedResponse if "error" in payload else FUTURE_TYPES[payload["type"]]
        elif route in ROUTE_TYPES:
            sdk_type = ROUTE_TYPES[route]
        else:
            continue
        extra = [field for field in unknown_fields(sdk_type, payload) if field != "type"]
        assert not extra, (route, sdk_type.__name__, extra, payload)
        checked.add(sdk_type)
    assert checked >= {*ROUTE_TYPES.values(), *FUTURE_TYPES.values(), types.RequestFailedResponse} - {
        TryAgainResponse}, checked   # (a long poll answers try_again after 20 s: not waited for here)


def test_an_answer_field_the_sdk_renamed_fails_the_call_saying_which(sdk_server, monkeypatch):
    """A later SDK simulated: OptimStepResponse's `metrics` renamed `step_metrics`, GetInfoResponse's `lora_rank`
    renamed `rank`. Before, aspen sent its dicts anyway and the SDK dropped the field it no longer knew: optim_step
    answered no metrics, get_info no rank, without an error. Now the answer is built with the SDK's type: the
    optim_step fails (RequestFailedError) and get_info answers 500, each naming the field and what to do."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    training.forward_backward(datums(batch(1)), "cross_entropy").result()
    assert training.optim_step(types.AdamParams(**ADAM)).result().metrics is not None   # as released

    class RenamedStep(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(frozen=True, extra="ignore")
        step_metrics: dict[str, float] | None = None

    class RenamedInfo(types.GetInfoResponse):
        model_config = pydantic.ConfigDict(frozen=True, extra="ignore", protected_namespaces=())
        rank: int | None = None
    RenamedInfo.model_fields.pop("lora_rank")
    RenamedInfo.model_rebuild(force=True)
    monkeypatch.setattr(types, "OptimStepResponse", RenamedStep)
    with pytest.raises(tinker.RequestFailedError, match="'metrics'.*RenamedStep.*out of step"):
        training.optim_step(types.AdamParams(**ADAM)).result()
    monkeypatch.setattr(types, "GetInfoResponse", RenamedInfo)
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": training.model_id},
                        headers={"X-API-Key": "tml-alice-token"})
    assert answer.status_code == 500 and "'lora_rank'" in answer.json()["detail"], answer.text
    monkeypatch.undo()
    client.close("success").result()
