"""Custom losses run on the server (the SDK's `ServiceClient.create_custom_loss`, aspen's client config turning
`custom_loss_server_side` on), driven by the real `tinker` SDK against aspen's Tinker API under uvicorn. The
reference is the SDK's own client-side run of the same traced loss (the same handle without its `loss_id`: a
forward, the loss and its gradient on the client, then a forward-backward of the gradient as weights): both
compute the same float32 operations on the same log-probabilities and hand the base the same gradient, so the
adapters they train are equal bit for bit. Failure paths: a graph that calls what is not allowed is refused at
creation naming its node; a loss that fails on a datum fails that call alone; a loss of another session is
refused."""

from __future__ import annotations

import dataclasses
import threading

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.models import VOCAB
from tests.helpers.tinker_sdk import tiny_api

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why

BASE = "tiny-llama"
KEYS = {"alice-token": "alice", "bob-token": "bob"}
ADAM = types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tiny_api(tmp_path, KEYS, window_s=0.1) as served:
        yield served


def rl_data(seed: int, count: int = 3) -> list[types.Datum]:
    """Datums as an RL loop makes them: target tokens, the sampler's log-probabilities, advantages (0 on the
    prompt) and a mask of the sampled tokens."""
    generator = np.random.default_rng(seed)
    data = []
    for _ in range(count):
        length = int(generator.integers(6, 20))
        prompt = int(generator.integers(1, length - 2))
        mask = np.array([0.0] * prompt + [1.0] * (length - prompt), dtype=np.float32)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(generator.integers(0, VOCAB, length).tolist()),
            loss_fn_inputs={"target_tokens": generator.integers(0, VOCAB, length).astype(np.int64),
                            "logprobs": (-generator.random(length) * 4).astype(np.float32),
                            "advantages": (mask * float(generator.normal())).astype(np.float32),
                            "mask": mask}))
    return data


def drift_penalized_pg(logprobs, logprobs_old, advantages, mask):
    """A policy gradient over the sampled tokens with a quadratic penalty on the drift from the sampler, and two
    metrics."""
    drift = logprobs - logprobs_old
    objective = logprobs * advantages - 0.05 * drift * drift
    loss = -(objective * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"custom/drift:mean": (drift.abs() * mask).sum(), "custom/tokens:sum": mask.sum()}


def with_old(data: list[types.Datum]) -> list[types.Datum]:
    """The datums with the sampler's log-probabilities under the name the loss takes (`logprobs` is its first
    parameter: the model's)."""
    return [dataclasses.replace(d, loss_fn_inputs={**d.loss_fn_inputs, "logprobs_old": d.loss_fn_inputs["logprobs"]})
            for d in data]


def test_a_loss_run_on_the_server_trains_as_the_sdk_runs_it_on_the_client(server):
    url, backend, steps = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    handle = client.create_custom_loss(drift_penalized_pg, {"logprobs": 1, "logprobs_old": 1, "advantages": 1,
                                                    "mask": 1}).result()
    assert handle.loss_id is not None, "aspen's client config runs custom losses on the server"
    on_client = dataclasses.replace(handle, loss_id=None)   # the SDK's own client-side run of the same graph
    served = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    reference = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    for seed in range(3):
        data = with_old(rl_data(seed))
        ours = served.forward_backward_custom(data, handle).result()
        theirs = reference.forward_backward_custom(data, on_client).result()
        for key in ("loss:sum", "custom/drift:mean", "custom/tokens:sum"):
            assert ours.metrics[key] == theirs.metrics[key], key
        for mine, its in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs, strict=True):
            assert mine["logprobs"].tolist() == its["logprobs"].tolist()
        served.optim_step(ADAM).result()
        reference.optim_step(ADAM).result()
    paths = [training.save_weights_for_sampler("final").result().path for training in (served, reference)]
    passes = [sum(training.model_id in step["models"] for step in steps) for training in (served, reference)]
    assert passes == [3, 6], "on the server one forward-backward a call; on the client a forward, then one more"
    weights = [load_file(str(backend.folder(path.split("/")[2]) / "sampler_weights" / "final"
                             / "adapter_model.safetensors")) for path in paths]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert any(not torch.equal(weights[0][name], torch.zeros_like(weights[0][name]))
               for name in weights[0] if "lora_B" in name), "the adapter trained"
    client.close("success").result()


def test_a_custom_loss_equal_to_a_built_in_one_gives_its_loss_and_log_probabilities(server):
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")

    def importance_sampling(logprobs, logprobs_old, advantages):
        return (-(torch.exp(logprobs - logprobs_old) * advantages)).sum(), {}

    handle = client.create_custom_loss(importance_sampling, {"logprobs": 1, "logprobs_old": 1,
                                                             "advantages": 1}).result()
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    data = with_old(rl_data(7))
    custom = training.forward_backward_custom(data, handle).result()
    built_in = training.forward([dataclasses.replace(d, loss_fn_inputs={
        key: value for key, value in d.loss_fn_inputs.items() if key not in ("logprobs_old", "mask")})
        for d in data], "importance_sampling").result()
    assert custom.metrics["loss:sum"] == built_in.metrics["loss:sum"]
    assert [o["logprobs"].tolist() for o in custom.loss_fn_outputs] == \
        [o["logprobs"].tolist() for o in built_in.loss_fn_outputs]
    client.close("success").result()


def encoded(loss, ranks) -> dict:
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(loss, ranks, "any")
    return {"name": handle.name, "inputs": [{"name": name, "rank": rank} for name, rank in ranks.items()],
            "graph": encode_graph(handle).model_dump(mode="json")}


def test_a_graph_calling_what_is_not_allowed_is_refused_at_creation_naming_its_node(server):
    """The SDK checks a loss on the client, but the server reads whatever graph it is sent: a node naming
    `os.system`, a module or a captured tensor is refused (400), and nothing runs."""
    url, _, _ = server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    session_id = client.holder.get_session_id()

    def plain(logprobs):
        return -logprobs.sum(), {}

    body = encoded(plain, {"logprobs": 1})
    headers = {"X-API-Key": "tml-alice-token"}
    evil = [dict(node) for node in body["graph"]["nodes"]]
    evil[1] = {**evil[1], "op": "call_function", "target": "os.system", "args": ["touch /tmp/aspen-custom-loss-ran"]}
    in_place = [dict(node) for node in body["graph"]["nodes"]]
    in_place[1] = {**in_place[1], "op": "call_method", "target": "add_", "args": [{"ref": "logprobs"}, 1.0]}
    for nodes, says in ((evil, "os.system is not an operation"), (in_place, "Tensor.add_ is not a method")):
        answer = httpx.post(f"{url}/api/v1/create_custom_loss", headers=headers, timeout=30, json={
            **body, "session_id": session_id, "custom_loss_seq_id": 7, "graph": {"format": 1, "nodes": nodes}})
        assert answer.status_code == 400, answer.text
        assert says in answer.json()["detail"] and f"node '{nodes[1]['name']}'" in answer.json()["detail"]
    import os

    assert not os.path.exists("/tmp/aspen-custom-loss-ran")
    client.close("success").result()


def test_a_loss_that_fails_on_a_datum_fails_that_call_alone(server):
    """A loss whose operands would broadcast past its bound, or that returns no scalar, fails its own call with
    the node and the reason, before the step; another user's call sent at the same moment trains."""
    url, _, _ = server
    alice = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")

    def triples(logprobs):   # (N, N, N): past the bound (2**20 elements at least) for N beyond 101
        return (logprobs[:, None, None] * logprobs[None, :, None] * logprobs[None, None, :]).sum(), {}

    def per_token(logprobs):
        return -logprobs, {}

    bad = [alice.create_custom_loss(triples, {"logprobs": 1}).result(),
           alice.create_custom_loss(per_token, {"logprobs": 1}).result()]
    training = alice.create_lora_training_client(base_model=BASE, rank=4).result()
    partner = bob.create_lora_training_client(base_model=BASE, rank=4).result()
    long = [types.Datum(model_input=types.ModelInput.from_ints([1] * 128),
                        loss_fn_inputs={"target_tokens": np.ones(128, dtype=np.int64)})]
    for handle, data, says in ((bad[0], long, "broadcast to (128, 128, 128)"),
                               (bad[1], with_old(rl_data(1)), "must return a scalar")):
        results: dict[str, object] = {}

        def partner_call(results: dict[str, object] = results) -> None:
            results["bob"] = partner.forward_backward(rl_data(2), "importance_sampling").result()

        thread = threading.Thread(target=partner_call)
        thread.start()
        with pytest.raises(Exception) as failed:
            training.forward_backward_custom(data, handle).result()
        thread.join(timeout=120)
        assert says in str(failed.value) and handle.name in str(failed.value)
        assert results["bob"].metrics["loss:sum"] != 0.0
    alice.close("success").result()
    bob.close("success").result()


def test_a_loss_of_another_session_is_refused(server):
    url, _, _ = server
    first = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    second = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")

    def plain(logprobs):
        return -logprobs.sum(), {}

    handle = first.create_custom_loss(plain, {"logprobs": 1}).result()
    training = second.create_lora_training_client(base_model=BASE, rank=4).result()
    # the SDK checks the handle's session on the client; one that claims the other session reaches the server
    claimed = dataclasses.replace(handle, session_id=second.holder.get_session_id())
    with pytest.raises(tinker.BadRequestError, match="no custom loss .* in session"):
        training.forward_backward_custom(rl_data(3), claimed).result()
    first.close("success").result()
    second.close("success").result()
