"""The Tinker API (orchestrator/tinker/) served by uvicorn, driven by the real `tinker` SDK as its users run
it: a supervised loop (forward_backward with cross_entropy, optim_step) trains an adapter equal, bit for bit,
to the same calls made on aspen's engine in this process; two users' loops at once share fused passes and each
sees only their own models; forward_backward_custom (the SDK computes the loss from the logprobs) trains as
cross_entropy does; a datum the base cannot take fails that user's call alone; a session that stops beating
ends, and its models leave the base; limits, saved state, train_unembed and the RL losses as the SDK sends them
(sampling: test_tinker_sampling.py; checkpoints and runs: test_tinker_checkpoints.py)."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import torch

from actors.engine.interactive_model import InteractiveModel
from actors.engine.interactive_step import CallDatum, ModelCall, run_calls
from actors.engine.models import from_module
from tests.helpers.models import VOCAB, tiny_model
from tests.helpers.tinker_sdk import datums

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_tinker_clients")   # tests/conftest.py says why
from tests.helpers.tinker_api import (  # noqa: E402
    ADAM,
    BASE,
    batch,
    engine_reference,
    saved_weights,
    sdk_loop,
    train_steps,
)


def test_the_sdks_supervised_loop_trains_what_the_engine_trains_bit_for_bit(sdk_server):
    url, backend, _ = sdk_server
    seeds = [1, 2, 3]
    model_id, losses, path = sdk_loop(url, "alice-token", seeds)
    expected, expected_losses = engine_reference(seeds)
    assert losses == expected_losses
    weights = saved_weights(backend, path)
    assert set(weights) == set(expected) and len(weights) > 0
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert model_id not in backend.calls.models, "closing the session takes its models off the base"


def test_two_users_loops_share_fused_passes_and_see_only_their_own_models(sdk_server):
    url, backend, steps = sdk_server
    results: dict[str, tuple[str, list[float], str]] = {}
    alone_seeds = {"alice-token": [1, 2, 3], "bob-token": [4, 5, 6]}
    together = threading.Barrier(2)

    def run(key: str) -> None:
        results[key] = sdk_loop(url, key, alone_seeds[key], together=together)

    threads = [threading.Thread(target=run, args=(key,)) for key in alone_seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert set(results) == set(alone_seeds)
    shared = [step for step in steps if step["backward"] and len(step["models"]) == 2]
    assert shared, f"no fused pass held both users' models: {steps}"
    for key, seeds in alone_seeds.items():   # each user's adapter as if trained alone
        expected, expected_losses = engine_reference(seeds)
        assert results[key][1] == expected_losses, key
        weights = saved_weights(backend, results[key][2])
        assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items()), key


def test_another_users_model_is_not_found_and_a_bad_key_is_refused(sdk_server):
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    model_id = training.model_id
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                        headers={"X-API-Key": "tml-bob-token"})
    assert answer.status_code == 404 and "no model" in answer.json()["detail"]
    answer = httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                        headers={"X-API-Key": "tml-mallory"})
    assert answer.status_code == 401
    assert httpx.post(f"{url}/api/v1/get_info", json={"model_id": model_id, "type": "get_info"},
                      headers={"X-API-Key": "tml-alice-token"}).json()["lora_rank"] == 4
    client.close("success").result()


def test_forward_backward_custom_trains_as_cross_entropy_does(sdk_server):
    url, backend, _ = sdk_server
    seeds = [7, 8]
    _, custom, path = sdk_loop(url, "alice-token", seeds, custom=True)
    expected, expected_losses = engine_reference(seeds)
    # the SDK's loss is its own sum of the logprobs it was sent: the same terms, summed in another order
    assert custom == pytest.approx(expected_losses, rel=1e-5)
    weights = saved_weights(backend, path)
    for name, tensor in expected.items():   # its gradients: the weights of a cross_entropy call
        assert torch.allclose(weights[name], tensor, rtol=1e-4, atol=1e-6), name


def test_a_datum_outside_the_vocabulary_fails_that_call_alone(sdk_server):
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, VOCAB + 5]),
                      loss_fn_inputs={"target_tokens": np.array([1, 2, 3]), "weights": np.ones(3, np.float32)})
    with pytest.raises(tinker.RequestFailedError, match="outside the base's vocabulary"):
        training.forward_backward([bad], "cross_entropy").result()
    good = training.forward_backward(datums(batch(1)), "cross_entropy").result()   # the model goes on
    assert good.metrics["loss:sum"] > 0
    assert len(good.loss_fn_outputs) == 2 and set(good.loss_fn_outputs[0]) == {"logprobs", "elementwise_loss"}
    client.close("success").result()


def test_a_session_that_stops_beating_ends_and_its_models_leave_the_base(sdk_server, monkeypatch):
    url, backend, _ = sdk_server
    backend.sessions.heartbeat_timeout_s = 0.5
    headers = {"X-API-Key": "tml-alice-token"}
    session = httpx.post(f"{url}/api/v1/create_session", headers=headers,
                         json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    created = httpx.post(f"{url}/api/v1/create_model", headers=headers,
                         json={"session_id": session, "model_seq_id": 0, "base_model": BASE,
                               "lora_config": {"rank": 4}}).json()
    model_id = created["model_id"]
    assert model_id in backend.calls.models
    deadline = time.monotonic() + 30
    while model_id in backend.calls.models and time.monotonic() < deadline:
        time.sleep(0.2)
    assert model_id not in backend.calls.models
    answer = httpx.post(f"{url}/api/v1/session_heartbeat", headers=headers,
                        json={"session_id": session, "type": "session_heartbeat"})
    assert answer.status_code == 410   # the SDK stops beating on 410


def test_a_call_over_the_limits_is_refused_saying_so(sdk_server, monkeypatch):
    from orchestrator.tinker import tinker_routes

    url, backend, _ = sdk_server
    monkeypatch.setattr(tinker_routes, "MAX_CALL_TOKENS", 10)
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.APIStatusError, match="at most 1024 datums and 10 tokens a call"):
        training.forward_backward(datums(batch(1)), "cross_entropy").result()
    monkeypatch.undo()
    assert training.forward_backward(datums(batch(1)), "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    client.close("success").result()


def test_a_call_past_the_servers_limit_of_a_call_is_sent_in_chunks_by_the_sdk(sdk_server, monkeypatch):
    """The client config tells the SDK how large a chunk of a call aspen takes, so that a forward_backward of more
    tokens than a call may hold is split by the SDK and answered whole (it was refused, 413): the same
    log-probabilities, datum by datum, as the call made in one piece, and its loss the sum of theirs."""
    from orchestrator.tinker import tinker_routes

    url, _, _ = sdk_server
    rows = datums(batch(7, 8))
    whole_client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    whole = whole_client.create_lora_training_client(base_model=BASE, rank=4).result()
    expected = whole.forward_backward(rows, "cross_entropy").result(timeout=60)
    monkeypatch.setattr(tinker_routes, "MAX_CALL_TOKENS", 32)   # each datum fits; the call's 8 do not
    assert sum(row.model_input.length for row in rows) > 32
    client = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    result = training.forward_backward(rows, "cross_entropy").result(timeout=60)
    assert [out["logprobs"].tolist() for out in result.loss_fn_outputs] == \
        [out["logprobs"].tolist() for out in expected.loss_fn_outputs]
    by_hand = sum(-float(np.dot(out["logprobs"].tolist(), row.loss_fn_inputs["weights"].tolist()))
                  for out, row in zip(result.loss_fn_outputs, rows, strict=True))
    assert result.metrics["loss:sum"] == pytest.approx(by_hand, rel=1e-5)
    assert result.metrics["loss:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    client.close("success").result()
    whole_client.close("success").result()


def test_a_refused_call_holds_up_none_of_the_models_later_calls(sdk_server):
    """The SDK numbers a model's calls and the server runs them in that order: calls the server refuses (a state
    saved again under its name, a state that does not exist, a sampler save's time to live out of range) do not
    leave their places empty, so the loop after them trains as the engine does (it hung, each call waiting for the
    refused one)."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    training.save_state("kept").result(timeout=60)
    with pytest.raises(tinker.UnprocessableEntityError, match="exists; save under another name"):
        training.save_state("kept").result(timeout=60)
    with pytest.raises(tinker.NotFoundError, match="no saved state"), pytest.warns(FutureWarning):
        training.load_state(f"tinker://{training.model_id}/weights/missing").result(timeout=60)
    with pytest.raises(tinker.UnprocessableEntityError, match="ttl_seconds"):
        training.save_weights_for_sampler("short", ttl_seconds=1).result(timeout=60)
    losses = []
    for seed in (1, 2):
        losses.append(training.forward_backward(datums(batch(seed)), "cross_entropy").result(timeout=60)
                      .metrics["loss:sum"])
        training.optim_step(types.AdamParams(**ADAM)).result(timeout=60)
    assert losses == engine_reference([1, 2])[1]
    client.close("success").result()


def test_a_saved_state_resumes_as_if_never_interrupted(sdk_server):
    """Two steps, save_state, two more steps; against two steps, save_state, a new client created from that
    state (weights and AdamW's moments), the same two steps: the same adapter, bit for bit."""
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    train_steps(training, (1, 2))
    state = training.save_state("after-2").result()
    train_steps(training, (3, 4))
    straight = saved_weights(backend, training.save_weights_for_sampler("straight").result().path)
    resumed = client.create_training_client_from_state_with_optimizer(state.path).result()
    train_steps(resumed, (3, 4))
    again = saved_weights(backend, resumed.save_weights_for_sampler("resumed").result().path)
    assert set(again) == set(straight)
    for name, tensor in straight.items():
        assert torch.equal(again[name], tensor), name
    bob = tinker.ServiceClient(base_url=url, api_key="tml-bob-token")
    with pytest.raises(tinker.NotFoundError, match="no saved state"):
        bob.create_training_client_from_state(state.path).result()
    client.close("success").result()
    bob.close("success").result()


def test_train_unembed_as_the_sdk_asks_it(sdk_server):
    """The SDK's default (`train_unembed=True`) trains LoRA on the LM head too: its saves hold `lm_head`'s A and B
    (B no longer zero after a step) and say so (weights_info); `train_unembed=False` leaves the head alone; a state
    saved with the head resumes with it; a state without it loaded into a model with it is refused, saying why."""
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    rest = client.create_rest_client()
    with_head = client.create_lora_training_client(base_model=BASE, rank=4).result()
    without = client.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False).result()
    for training in (with_head, without):
        train_steps(training, (1,))
    saved = saved_weights(backend, with_head.save_weights_for_sampler("head").result().path)
    assert saved["base_model.model.lm_head.lora_B.weight"].abs().max() > 0
    assert saved["base_model.model.lm_head.lora_A.weight"].shape == (4, tiny_model("llama", VOCAB).config.hidden_size)
    plain = without.save_weights_for_sampler("plain").result().path
    assert not any("lm_head" in name for name in saved_weights(backend, plain))
    state = with_head.save_state("head-state").result()
    assert rest.get_weights_info_by_tinker_path(state.path).result().train_unembed is True
    assert rest.get_weights_info_by_tinker_path(plain).result().train_unembed is False
    resumed = client.create_training_client_from_state(state.path).result()
    back = saved_weights(backend, resumed.save_weights_for_sampler("resumed").result().path)
    assert torch.equal(back["base_model.model.lm_head.lora_B.weight"], saved["base_model.model.lm_head.lora_B.weight"])
    attention = client.create_lora_training_client(base_model=BASE, rank=4, train_mlp=False).result()
    train_steps(attention, (2,))
    attention_state = attention.save_state("attention-state").result()
    again = client.create_training_client_from_state_with_optimizer(attention_state.path).result()
    kept = saved_weights(backend, again.save_weights_for_sampler("attention-again").result().path)
    first = saved_weights(backend, attention.save_weights_for_sampler("attention").result().path)
    assert set(kept) == set(first) and not any("mlp" in name for name in kept)   # its own layers, no more
    plain_state = without.save_state("plain-state").result()
    with pytest.raises(tinker.RequestFailedError, match=r"train_unembed False \(this model: True\)"):
        with_head.load_state(plain_state.path).result()
    client.close("success").result()


def test_loading_a_state_of_another_rank_names_both_ranks_and_what_creates_its_own(sdk_server):
    """load_state of a rank-8 state (trained parts: attention only) into a rank-4 model (attention and MLP) names
    the two ranks and the part that differs, and points to create_training_client_from_state (it said "no tensor
    ...lora_A.weight of shape (4, 64)"); the client that call creates loads it and has its rank; the model
    refused is unchanged (it still trains)."""
    url, _, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    eight = client.create_lora_training_client(base_model=BASE, rank=8, train_mlp=False).result()
    train_steps(eight, (1,))
    state = eight.save_state("rank-8").result()
    four = client.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError,
                       match=r"LoRA settings are not this model's: rank 8 \(this model: 4\), train_mlp False "
                             r"\(this model: True\); .*create_training_client_from_state"):
        four.load_state(state.path).result()
    train_steps(four, (2,))
    assert client.create_training_client_from_state(state.path).result().get_info().lora_rank == 8
    client.close("success").result()


@pytest.mark.parametrize("loss_fn, config", [("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                                             ("gspo", None)])
def test_an_rl_loss_with_its_config_through_the_sdk_is_the_engines(sdk_server, loss_fn, config):
    """The loss function, its inputs and its config cross the wire as the SDK writes them (loss_fn_config_v2):
    ppo with its bounds; gspo with its sequence_ratio_mask (the sampled tokens, as the cookbook's rl_loop marks them)
    and its defaults."""
    url, backend, _ = sdk_server
    generator = np.random.default_rng(3)
    rows = []
    for _ in range(2):
        length = int(generator.integers(5, 15))
        tokens, targets = generator.integers(0, VOCAB, length).tolist(), generator.integers(0, VOCAB, length).tolist()
        inputs = {"logprobs": (-generator.random(length) * 5).astype(np.float32),
                  "advantages": generator.normal(size=length).astype(np.float32)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (np.arange(length) >= 2).astype(np.float32)   # after a 2-token prompt
        rows.append((tokens, targets, inputs))
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": np.array(targets, dtype=np.int64), **inputs})
            for tokens, targets, inputs in rows]
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    result = training.forward_backward(data, loss_fn, loss_fn_config=config).result()
    base = from_module(tiny_model("llama", VOCAB), None)
    InteractiveModel(base, "reference", 4, train_unembed=True)   # the SDK's default
    call = ModelCall("reference", tuple(CallDatum(tuple(tokens), {"target_tokens": torch.tensor(targets), **{
        name: torch.from_numpy(value) for name, value in inputs.items()}}) for tokens, targets, inputs in rows),
        loss_fn, config)
    (expected,) = run_calls(base, [call], backward=True)
    assert result.metrics["loss:sum"] == expected.loss_sum
    for output, logprobs in zip(result.loss_fn_outputs, expected.logprobs, strict=True):
        assert np.array_equal(output["logprobs"].to_numpy(), logprobs.numpy())
    client.close("success").result()


def test_an_optimizer_other_than_adamw_is_refused_and_a_weights_only_state_starts_adams_moments_afresh(sdk_server):
    """The SDK's `optimizer=` (create_lora_training_client, create_training_client_from_state): the Dimuon optimizer is
    refused saying aspen trains with AdamW only (it was silently trained with AdamW); AdamW is taken. As the SDK
    documents, create_training_client_from_state loads the weights alone: its first step is a fresh AdamW's, each
    weight moved by the learning rate (lr * |g| / (|g| + eps) after bias correction); _with_optimizer's is not."""
    url, backend, _ = sdk_server
    client = tinker.ServiceClient(base_url=url, api_key="tml-alice-token")
    with pytest.raises(tinker.APIStatusError, match="'dimuon' optimizer: aspen trains with AdamW only"):
        client.create_lora_training_client(base_model=BASE, rank=4, optimizer=types.DimuonOptimizerConfig()).result()
    training = client.create_lora_training_client(base_model=BASE, rank=4,
                                                  optimizer=types.AdamOptimizerConfig()).result()
    train_steps(training, (1, 2))
    state = training.save_state("adam").result()
    with pytest.raises(tinker.APIStatusError, match="'dimuon' optimizer: aspen trains with AdamW only"):
        client.create_training_client_from_state(state.path, optimizer=types.DimuonOptimizerConfig()).result()
    before = saved_weights(backend, training.save_weights_for_sampler("before").result().path)
    moved = {}
    for name, resumed in (("fresh", client.create_training_client_from_state(
            state.path, optimizer=types.AdamOptimizerConfig()).result()),
                          ("restored", client.create_training_client_from_state_with_optimizer(state.path).result())):
        train_steps(resumed, (3,))
        after = saved_weights(backend, resumed.save_weights_for_sampler(name).result().path)
        moved[name] = torch.cat([(after[key] - before[key]).abs().flatten() for key in before])
    lr = ADAM["learning_rate"]
    assert (moved["fresh"] <= lr * (1 + 1e-4)).all()   # lr * |g| / (|g| + eps): less only where |g| nears eps
    assert ((moved["fresh"] - lr).abs() < 1e-4).float().mean() > 0.999
    assert ((moved["restored"] - lr).abs() < 1e-4).float().mean() < 0.5
    client.close("success").result()
